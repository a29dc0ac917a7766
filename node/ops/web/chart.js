// Line charts for the dashboard: hand-written SVG, no library, nothing fetched from elsewhere.
// Axes get "nice" ticks (1-2-5 steps; 1-2-5 within each decade on a log axis); tick labels are measured in
// the page, so the plot starts right of the widest one and no text is drawn outside the chart's viewBox.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const FONT_PX = 10;  // svg text's size in dashboard.css, in viewBox units: the fallback for measuring
const SI = ["", "k", "M", "G", "T", "P"];
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600];  // seconds: steps a reader counts in

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

// The 1-2-5 step that splits `span` into about `count` intervals (the nearest on a log scale).
function niceStep(span, count) {
  const raw = span / Math.max(count, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const f = raw / mag;
  return (f < Math.SQRT2 ? 1 : f < Math.sqrt(10) ? 2 : f < Math.sqrt(50) ? 5 : 10) * mag;
}

const clean = v => Number(v.toPrecision(12));  // 0.30000000000000004 -> 0.3

// A linear axis over [lo, hi] widened to whole steps: {lo, hi, ticks: [[value, step]], at: v -> 0..1}.
function linearAxis(lo, hi, count) {
  if (hi - lo < 1e-12 * Math.max(1, Math.abs(hi))) {  // a flat line: between readable ticks, never below a zero
    if (lo === 0) hi = 1;
    else { const pad = Math.abs(lo) * 0.1; lo -= pad; hi += pad; }
  }
  const step = niceStep(hi - lo, count);
  const a = Math.floor(lo / step + 1e-9) * step, b = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let i = 0; a + i * step <= b + step * 1e-9; i++) ticks.push([clean(a + i * step), step]);
  return { lo: a, hi: b, ticks, at: v => (v - a) / (b - a) };
}

// A log axis over positive [lo, hi]: ticks at 1, 2, 5 times each power of ten (fewer over many decades).
function logAxis(lo, hi) {
  const d0 = Math.floor(Math.log10(lo)), d1 = Math.ceil(Math.log10(hi));
  const decades = Math.max(d1 - d0, 1);
  const mantissas = decades <= 3 ? [1, 2, 5] : [1];
  const stride = Math.ceil(decades / 6);
  const all = [];
  for (let d = d0; d <= d1; d++) {
    if ((d - d0) % stride) continue;
    for (const m of mantissas) all.push([clean(m * Math.pow(10, d)), Math.pow(10, d)]);
  }
  const below = all.filter(([v]) => v <= lo), above = all.filter(([v]) => v >= hi);
  const a = below.length ? below[below.length - 1][0] : all[0][0];
  const b = above.length ? above[0][0] : all[all.length - 1][0];
  const la = Math.log10(a), lb = Math.log10(b);
  return { lo: a, hi: b, ticks: all.filter(([v]) => v >= a && v <= b), at: v => (Math.log10(v) - la) / (lb - la) };
}

// A tick label: decimals from the step, an SI prefix from a thousand up (from ten thousand without a unit),
// an exponent below a ten-thousandth. `unit` is appended after a space ("200 kB").
function tickLabel(value, step, unit) {
  const v = Math.abs(value) < step * 1e-6 ? 0 : value;
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 1e-4) {
    const digits = Math.max(0, Math.floor(Math.log10(a) + 1e-9) - Math.floor(Math.log10(step) + 1e-9));
    return v.toExponential(Math.min(digits, 3)).replace(/^-/, "−") + (unit ? ` ${unit}` : "");
  }
  const p = a >= (unit ? 1e3 : 1e4) ? Math.min(Math.floor(Math.log10(a) / 3 + 1e-9), SI.length - 1) : 0;
  const scale = Math.pow(1000, p);
  const decimals = Math.min(6, Math.max(0, Math.ceil(-Math.log10(step / scale) - 1e-9)));
  const number = (v / scale).toFixed(decimals).replace("-", "−");  // a typographic minus, as the time axis has
  if (unit) return `${number} ${SI[p]}${unit}`;
  return number + SI[p];
}

// Time ticks back from the newest point: {step, ticks: [seconds ago]} with at most about five intervals.
function timeTicks(span) {
  const step = TIME_STEPS.find(s => span / s <= 5) || Math.ceil(span / 5 / 3600) * 3600;
  const ticks = [];
  for (let s = 0; s <= span + 1e-9; s += step) ticks.push(s);
  return ticks;
}

function timeLabel(ago) {
  if (ago === 0) return "now";
  return ago % 60 === 0 ? `−${ago / 60} min` : `−${ago} s`;
}

// The width of `text` once drawn in `chart`; an estimate where the page is not laid out (a hidden tab).
function textWidth(chart, node) {
  chart.append(node);
  let width = 0;
  try { width = node.getComputedTextLength(); } catch (err) { width = 0; }
  return width > 0 ? width : 0.62 * FONT_PX * node.textContent.length;
}

// Draws `series` ([{label, colour, dash, peer, points: [[t, value]]}]) into the svg `chart` (its viewBox sets
// the size). opts: log (a log axis when every value is positive and they span a decade), zero (the axis
// includes 0), unit (appended to tick labels, SI-prefixed), mirror (series with `below` are drawn under
// the zero line, their ticks labelled with magnitudes), legend (a key with line swatches above the plot).
function renderChart(chart, series, opts) {
  opts = opts || {};
  const box = chart.viewBox.baseVal;
  const W = box.width, H = box.height;
  chart.replaceChildren();
  const drawn = series.map(s => ({ ...s, points: s.points.map(([t, v]) => [t, s.below ? -v : v]) }));
  const all = drawn.flatMap(s => s.points);
  if (all.length === 0) {
    chart.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
    return;
  }
  const values = all.map(p => p[1]);
  let lo = Math.min(...values), hi = Math.max(...values);
  const log = opts.log && lo > 0 && hi / lo >= 10;  // loss spans decades: a log axis shows the fall
  if (opts.zero || opts.mirror) { lo = Math.min(0, lo); hi = Math.max(0, hi); }
  const top = opts.legend ? 8 + FONT_PX + 6 : 8, bottom = 22;
  const plotH = H - top - bottom;
  const axis = log ? logAxis(lo, hi) : linearAxis(lo, hi, Math.max(2, Math.round(plotH / 32)));
  const y = v => top + (1 - axis.at(v)) * plotH;

  // Labels first: the plot's left edge is where the widest one ends.
  const labels = axis.ticks.map(([v, step]) => {
    const text = tickLabel(opts.mirror ? Math.abs(v) : v, step, opts.unit);
    const node = svgEl("text", { y: y(v), "dominant-baseline": "middle", "text-anchor": "end", class: "y-tick" }, text);
    return [v, node, textWidth(chart, node)];
  });
  const left = Math.ceil(Math.max(...labels.map(l => l[2]))) + 8, right = W - 8;
  for (const [, node] of labels) node.setAttribute("x", left - 4);

  for (const [v] of labels) {
    const main = v === 0 && (opts.mirror || axis.lo < 0);
    chart.prepend(svgEl("line", { x1: left, x2: right, y1: y(v), y2: y(v), stroke: main ? "#999" : "#eee",
      "stroke-width": 1, class: "grid" }));
  }
  chart.append(svgEl("line", { x1: left, y1: top, x2: left, y2: top + plotH, stroke: "#999" }));

  const t0 = Math.min(...all.map(p => p[0])), t1 = Math.max(...all.map(p => p[0]));
  const span = Math.max(t1 - t0, 1);
  const x = t => left + (1 - (t1 - t) / span) * (right - left);
  let limit = right;  // x labels are placed right to left; one that would overlap its right neighbour is left out
  for (const ago of timeTicks(span)) {
    const at = x(t1 - ago);
    const node = svgEl("text", { x: at, y: H - 6, "text-anchor": ago === 0 ? "end" : "middle", class: "x-tick" },
      timeLabel(ago));
    const width = textWidth(chart, node);
    const from = ago === 0 ? at - width : at - width / 2;
    if ((ago === 0 ? at : at + width / 2) > limit || from < 0) { node.remove(); continue; }
    limit = from - 6;
    chart.append(svgEl("line", { x1: at, x2: at, y1: top + plotH, y2: top + plotH + 3, stroke: "#999" }));
  }

  for (const s of drawn) {
    if (s.points.length === 0) continue;
    const pts = s.points.map(p => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
    if (opts.mirror) {  // a light fill to the zero line tells above from below at a glance
      const base = y(0).toFixed(1);
      const first = x(s.points[0][0]).toFixed(1), last = x(s.points[s.points.length - 1][0]).toFixed(1);
      chart.append(svgEl("polygon", { points: [`${first},${base}`, ...pts, `${last},${base}`].join(" "),
        fill: s.colour, "fill-opacity": 0.12, stroke: "none" }));
    }
    const line = svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: s.colour, "stroke-width": 1.5,
      "stroke-dasharray": s.dash || "none", "data-peer": s.peer });
    line.append(svgEl("title", {}, s.label));
    chart.append(line);
  }

  if (opts.legend) {
    let at = left;
    for (const s of series) {
      const key = svgEl("g", { class: "legend" });
      key.append(svgEl("line", { x1: at, x2: at + 18, y1: 8 + FONT_PX / 2, y2: 8 + FONT_PX / 2, stroke: s.colour,
        "stroke-width": 2, "stroke-dasharray": s.dash || "none" }));
      const text = svgEl("text", { x: at + 22, y: 8 + FONT_PX / 2, "dominant-baseline": "middle" }, s.label);
      chart.append(key);
      key.append(text);
      at += 22 + textWidth(key, text) + 14;
    }
  }
}
