// Test-only, loaded after the dashboard's own scripts by tests/test_dashboard.py: once the charts are drawn, it
// writes each svg's box, the boxes of the texts inside it (in CSS pixels, as laid out) and its
// polylines and legend swatches into <pre id="boxes">.
"use strict";

function box(node) {
  const r = node.getBoundingClientRect();
  return [r.left, r.top, r.right, r.bottom];
}

function measureCharts() {
  if (!document.querySelector("#chart-loss polyline")) { setTimeout(measureCharts, 100); return; }
  const charts = {};
  for (const chart of document.querySelectorAll("svg.chart")) {
    charts[chart.id] = {
      box: box(chart),
      texts: [...chart.querySelectorAll("text")].map(t => ({ text: t.textContent, cls: t.getAttribute("class") || "",
        box: box(t) })),
      lines: [...chart.querySelectorAll("polyline")].map(line => ({ points: line.getAttribute("points"),
        stroke: line.getAttribute("stroke"), dash: line.getAttribute("stroke-dasharray") })),
      swatches: [...chart.querySelectorAll(".legend line")].map(line => ({ stroke: line.getAttribute("stroke"),
        dash: line.getAttribute("stroke-dasharray") })),
    };
  }
  const out = document.createElement("pre");
  out.id = "boxes";
  out.textContent = JSON.stringify(charts);
  document.body.append(out);
}

setTimeout(measureCharts, 100);
