// Small SVG charts for the dashboard, drawn with the DOM (no library).
(() => {
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function clockTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

// A time-series chart into `box` (a div). series: [{points: [[t, v], ...],
// cls, step (draw as steps), label}]; bands: [{from, to, cls, title}] (shaded
// time ranges); marks: [{t, cls, title}] (vertical ticks); opts: {height, yLabel, yMin}.
function timeChart(box, series, bands, marks, opts) {
  opts = opts || {};
  box.replaceChildren();
  const W = Math.max(box.clientWidth || 640, 320), H = opts.height || 160;
  const L = 48, R = 10, T = 10, B = 22;
  const ts = [], vs = [];
  for (const s of series) for (const [t, v] of s.points) { ts.push(t); vs.push(v); }
  for (const b of bands || []) ts.push(b.from, b.to);
  for (const m of marks || []) ts.push(m.t);
  const svg = svgEl("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "tchart" });
  if (!ts.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis" }, opts.empty || "no data yet"));
    box.appendChild(svg);
    return svg;
  }
  let t0 = Math.min(...ts), t1 = Math.max(...ts);
  if (t1 - t0 < 1) t1 = t0 + 1;
  const vMin = opts.yMin !== undefined ? opts.yMin : Math.min(0, ...vs);
  let vMax = vs.length ? Math.max(...vs) : 1;
  if (vMax <= vMin) vMax = vMin + 1;
  const x = (t) => L + (W - L - R) * (t - t0) / (t1 - t0);
  const y = (v) => H - B - (H - B - T) * (v - vMin) / (vMax - vMin);
  svg.appendChild(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis-line" }));
  svg.appendChild(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis-line" }));
  svg.appendChild(svgEl("text", { x: L - 4, y: T + 8, "text-anchor": "end", class: "axis" }, fmtNum(vMax)));
  svg.appendChild(svgEl("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "axis" }, fmtNum(vMin)));
  svg.appendChild(svgEl("text", { x: L, y: H - 6, class: "axis" }, clockTime(t0)));
  svg.appendChild(svgEl("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "axis" }, clockTime(t1)));
  if (opts.yLabel) svg.appendChild(svgEl("text", { x: 4, y: (H - B + T) / 2, class: "axis" }, opts.yLabel));
  for (const b of bands || []) {
    const r = svgEl("rect", { x: x(b.from), y: T, width: Math.max(2, x(b.to) - x(b.from)), height: H - B - T,
                              class: b.cls || "band" });
    r.appendChild(svgEl("title", {}, b.title || ""));
    svg.appendChild(r);
  }
  for (const s of series) {
    if (!s.points.length) continue;
    let d = "";
    s.points.forEach(([t, v], i) => {
      if (i === 0) d += `M${x(t)},${y(v)}`;
      else if (s.step) d += `H${x(t)}V${y(v)}`;
      else d += `L${x(t)},${y(v)}`;
    });
    if (s.extendTo !== undefined) d += `H${x(s.extendTo)}`;
    const path = svgEl("path", { d, class: s.cls || "line" });
    if (s.label) path.appendChild(svgEl("title", {}, s.label));
    svg.appendChild(path);
  }
  for (const m of marks || []) {
    const g = svgEl("line", { x1: x(m.t), x2: x(m.t), y1: T, y2: H - B, class: m.cls || "mark" });
    g.appendChild(svgEl("title", {}, m.title || ""));
    svg.appendChild(g);
  }
  box.appendChild(svg);
  return svg;
}

function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  return v.toFixed(a ? 3 : 0);
}

window.TidalCharts = { timeChart, fmtNum, clockTime };
})();
