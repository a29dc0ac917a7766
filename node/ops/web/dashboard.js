// Murmur dashboard: polls /api/swarm and draws it. Hand-written, no libraries, nothing fetched from elsewhere.
// Every string from the node or its peers is shown with textContent, never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const EVERY_MS = Number(new URLSearchParams(location.search).get("every")) || 1000;
const W = 400, H = 160, PAD = { l: 44, r: 6, t: 6, b: 18 };

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

// One polyline per peer; x is time over the window all series share, y the value scaled to the chart.
function renderChart(id, series, opts) {
  const chart = document.getElementById(id);
  const all = series.flatMap(s => s.points);
  const parts = [];
  if (all.length === 0) {
    parts.push(Object.assign(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }), { textContent: "no data yet" }));
    chart.replaceChildren(...parts);
    return;
  }
  const log = opts && opts.log && all.every(p => p[1] > 0);  // loss spans decades: a log axis shows the fall
  if (log) for (const s of series) s.points = s.points.map(p => [p[0], Math.log10(p[1])]);
  if (log) all.splice(0, all.length, ...series.flatMap(s => s.points));
  const t0 = Math.min(...all.map(p => p[0])), t1 = Math.max(...all.map(p => p[0]), t0 + 1);
  let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
  if (opts && opts.zero) y0 = Math.min(0, y0);
  if (y1 - y0 < 1e-9) { y1 += 0.5; y0 -= 0.5; }
  const x = t => PAD.l + (t - t0) / (t1 - t0) * (W - PAD.l - PAD.r);
  const y = v => H - PAD.b - (v - y0) / (y1 - y0) * (H - PAD.t - PAD.b);
  parts.push(svg("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, stroke: "#999" }));
  parts.push(svg("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, stroke: "#999" }));
  for (const [v, anchor] of [[y1, PAD.t + 8], [y0, H - PAD.b]]) {
    const label = svg("text", { x: PAD.l - 4, y: anchor, "text-anchor": "end" });
    label.textContent = fmt(log ? Math.pow(10, v) : v, 3);
    parts.push(label);
  }
  const span = svg("text", { x: W - PAD.r, y: H - 4, "text-anchor": "end" });
  span.textContent = `last ${fmt(t1 - t0, 3)} s${log ? " · log scale" : ""}`;
  parts.push(span);
  for (const s of series) {
    if (s.points.length === 0) continue;
    const pts = s.points.map(p => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    const line = svg("polyline", { points: pts, fill: "none", stroke: s.colour, "stroke-width": 1.5,
      "stroke-dasharray": s.dash || "none", "data-peer": s.peer });
    const title = svg("title");
    title.textContent = s.label;
    line.append(title);
    parts.push(line);
  }
  if (opts && opts.legend) {
    series.forEach((s, i) => {
      const key = svg("text", { x: W - PAD.r - 60 * (series.length - i), y: PAD.t + 8, fill: s.colour });
      key.textContent = `${s.dash ? "- -" : "—"} ${s.label}`;
      parts.push(key);
    });
  }
  chart.replaceChildren(...parts);
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
  return [
    { peer: data.self, colour: "#1f6feb", label: "in", points: rate("bytes_in") },
    { peer: data.self, colour: "#d4651f", label: "out", points: rate("bytes_out"), dash: "4 2" },
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
  renderChart("chart-loss", peerSeries(data, "loss"), { log: true });
  document.getElementById("metric-title").textContent = data.metric ? `Held-out ${data.metric}` : "Held-out metric";
  renderChart("chart-metric", peerSeries(data, "metric"));
  renderChart("chart-throughput", peerSeries(data, "samples_per_s"), { zero: true });
  renderChart("chart-idle", peerSeries(data, "idle"), { zero: true });
  renderChart("chart-traffic", trafficSeries(data), { zero: true, legend: true });
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
