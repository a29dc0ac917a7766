// Murmur dashboard: polls /api/swarm and draws it (charts: chart.js). Hand-written, no libraries, nothing fetched
// from elsewhere.
// Every string from the node or its peers is shown with textContent, never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const EVERY_MS = Number(new URLSearchParams(location.search).get("every")) || 1000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

// Distinct colours in the order peers are first seen, kept for the page's life; a hash past the palette.
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const colours = new Map();
function colour(peerId) {
  const id = String(peerId);
  if (!colours.has(id)) {
    let h = 0;
    for (const c of id) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    colours.set(id, colours.size < PALETTE.length ? PALETTE[colours.size] : `hsl(${h % 360}, 60%, 45%)`);
  }
  return colours.get(id);
}

function short(peerId) {
  const s = String(peerId);
  return s.length > 12 ? "…" + s.slice(-8) : s;
}

function fmt(v, digits) {
  if (v === null || v === undefined || typeof v !== "number" || !isFinite(v)) return "—";
  return Math.abs(v) >= 1000 ? v.toFixed(0) : v.toPrecision(digits || 3);
}

function swatch(peerId) {
  const s = el("span", undefined, "swatch");
  s.style.background = colour(peerId);
  return s;
}

function renderPeers(data) {
  const body = document.querySelector("#peers tbody");
  const rows = [];
  for (const p of data.peers) {
    const tr = el("tr", undefined, p.self ? "self" : "");
    tr.setAttribute("data-peer", p.peer_id);
    const name = el("td");
    name.append(swatch(p.peer_id), el("span", short(p.peer_id) + (p.self ? " (this node)" : "")));
    name.title = p.peer_id;
    tr.append(name, el("td", p.task), el("td", p.phase), el("td", fmt(p.samples_per_s, 4), "num"),
      el("td", p.idle === null ? "—" : fmt(p.idle * 100, 2) + " %", "num"), el("td", fmt(p.loss, 4), "num"),
      el("td", p.metric ? `${p.metric} ${fmt(p.metric_value, 4)}` : "—"), el("td", fmt(p.work, 4), "num"),
      el("td", p.self ? "now" : p.age_s === null ? "no summary" : `${fmt(p.age_s, 2)} s ago`, "num"));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  document.getElementById("peer-count").textContent = `(${data.peers.length})`;
}

function peerSeries(data, key) {
  return Object.entries(data.history).map(([peer, points]) => ({
    peer, colour: colour(peer), label: short(peer),
    points: points.filter(p => typeof p[key] === "number").map(p => [p.t, p[key]]),
  }));
}

function trafficSeries(data) {
  const points = data.history[data.self] || [];
  const rate = key => {
    const out = [];
    for (let i = 1; i < points.length; i++) {
      const dt = points[i].t - points[i - 1].t;
      if (dt > 0) out.push([points[i].t, Math.max(0, (points[i][key] - points[i - 1][key]) / dt)]);
    }
    return out;
  };
  // Sent is drawn below the zero line: in and out often match, and two lines on top of each other read as one.
  return [
    { peer: data.self, colour: "#1f6feb", label: "received (up)", points: rate("bytes_in") },
    { peer: data.self, colour: "#d4651f", label: "sent (down)", points: rate("bytes_out"), dash: "4 2", below: true },
  ];
}

function renderGraph(data) {
  const graph = document.getElementById("graph");
  const n = data.peers.length, cx = 200, cy = 120, r = 85;
  const pos = new Map(data.peers.map((p, i) => {
    const a = 2 * Math.PI * i / Math.max(n, 1) - Math.PI / 2;
    return [p.peer_id, [cx + r * Math.cos(a), cy + r * Math.sin(a)]];
  }));
  const parts = [];
  for (const [a, b] of data.edges) {
    if (!pos.has(a) || !pos.has(b)) continue;  // a partner we no longer know
    const [x1, y1] = pos.get(a), [x2, y2] = pos.get(b);
    parts.push(svg("line", { x1, y1, x2, y2, stroke: "#888", "stroke-width": 2, class: "edge" }));
  }
  for (const p of data.peers) {
    const [x, y] = pos.get(p.peer_id);
    const dot = svg("circle", { cx: x, cy: y, r: 9, fill: colour(p.peer_id), "data-peer": p.peer_id });
    const title = svg("title");
    title.textContent = p.peer_id;
    dot.append(title);
    const label = svg("text", { x, y: y + 22, "text-anchor": "middle" });
    label.textContent = short(p.peer_id);
    parts.push(dot, label);
  }
  graph.replaceChildren(...parts);
}

function renderExchanges(data) {
  const rows = data.exchanges.slice().reverse().map(ex => {
    const tr = el("tr");
    const partner = el("td");
    partner.append(swatch(ex.partner), el("span", short(ex.partner || "—")));
    partner.title = ex.partner || "";
    tr.append(partner, el("td", ex.result, ex.result), el("td", ex.reason, "reason"),
      el("td", `${fmt(ex.duration_s * 1000, 3)} ms`, "num"));
    return tr;
  });
  document.querySelector("#exchanges tbody").replaceChildren(...rows);
}

function render(data) {
  document.getElementById("self").textContent = data.self;
  renderPeers(data);
  const chart = id => document.getElementById(id);
  renderChart(chart("chart-loss"), peerSeries(data, "loss"), { log: true });
  chart("metric-title").textContent = data.metric ? `Held-out ${data.metric}` : "Held-out metric";
  renderChart(chart("chart-metric"), peerSeries(data, "metric"));
  renderChart(chart("chart-throughput"), peerSeries(data, "samples_per_s"), { zero: true });
  renderChart(chart("chart-idle"), peerSeries(data, "idle"), { zero: true });
  renderChart(chart("chart-traffic"), trafficSeries(data), { mirror: true, legend: true, unit: "B/s" });
  const sum = o => Object.values(o).reduce((a, b) => a + b, 0);
  document.getElementById("traffic-total").textContent =
    `total in ${fmt(sum(data.traffic.in) / 1048576, 3)} MiB · out ${fmt(sum(data.traffic.out) / 1048576, 3)} MiB` +
    (data.bytes_per_merge == null ? "" :
      ` · ${fmt(data.bytes_per_merge / 1048576, 3)} MiB per merge of a ${fmt(data.model_bytes / 1048576, 3)} MiB model`);
  renderGraph(data);
  renderExchanges(data);
}

async function poll() {
  const state = document.getElementById("state");
  try {
    const response = await fetch("/api/swarm", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    if (data.peers) {
      render(data);
      const updated = `updated ${new Date().toLocaleTimeString()}`;
      // A node that knows no peer says so, with why: it trains alone until one answers.
      state.textContent = data.joined === false ? `alone: ${data.alone_reason || "no peers yet"} · ${updated}` : updated;
      state.className = data.joined === false ? "alone" : "";
    } else {
      state.textContent = "waiting for the node's first report…";
    }
  } catch (err) {
    state.textContent = `cannot reach the node: ${err.message}`;
  }
  setTimeout(poll, EVERY_MS);  // after the answer, so a slow node never has two polls queued
}

poll();
