// Plotly helpers: one look for every chart (Grafana's DCGM habits: same time axis, units on every axis), WebGL
// traces for long series, min/max bands for downsampled data, dashed threshold lines.
export const COLORS = ["#29335c", "#e4572e", "#f3a712", "#669bbc", "#a8c686", "#8d6a9f", "#2a9d8f", "#bc4749",
  "#6c757d", "#f4a261", "#264653", "#e9c46a", "#9c6644", "#5e548e", "#52796f", "#ff70a6"];
export const SEV_COLORS = {ok: "#a8c686", info: "#669bbc", warning: "#f3a712", error: "#e4572e", critical: "#9d0208",
  down: "#333", stale: "#b0b0b0"};
export const CONFIG = {displayModeBar: false, responsive: true};

export function layout(extra = {}) {
  return Object.assign({margin: {l: 55, r: 10, t: 10, b: 35}, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    font: {size: 12}, legend: {orientation: "h", y: 1.15}, hovermode: "x unified"}, extra);
}

export const timeAxis = (extra = {}) => Object.assign({type: "date", title: ""}, extra);
export const toDates = (ts) => ts.map((t) => new Date(t * 1000));

// A downsampled series {t, field: {min, mean, max}} as a line with a shaded min..max band.
export function bandTraces(series, field, name, color, opts = {}) {
  const x = toDates(series.t);
  const s = series[field];
  if (!s) return [];
  const scale = opts.scale || 1;
  const f = (arr) => arr.map((v) => (v === null ? null : v * scale));
  const group = name;
  const out = [{type: "scattergl", mode: "lines", name, x, y: f(s.mean), line: {color, width: 1.5}, legendgroup: group}];
  if (opts.band !== false && s.min.some((v, i) => v !== s.max[i])) {
    out.unshift({type: "scatter", mode: "lines", x, y: f(s.max), line: {width: 0}, hoverinfo: "skip", showlegend: false, legendgroup: group});
    out.splice(1, 0, {type: "scatter", mode: "lines", x, y: f(s.min), line: {width: 0}, fill: "tonexty",
      fillcolor: color + "33", hoverinfo: "skip", showlegend: false, legendgroup: group});
  }
  return out;
}

// A horizontal dashed line at y (a threshold or a limit), labelled.
export function hline(y, text, color = "#e4572e") {
  return {shape: {type: "line", xref: "paper", x0: 0, x1: 1, y0: y, y1: y, line: {color, dash: "dash", width: 1.5}},
    annotation: {xref: "paper", x: 1, y, text, showarrow: false, xanchor: "right", yanchor: "bottom", font: {color, size: 11}}};
}

// Shaded vertical bands (throttle reasons, a finding's window) from [[t0, t1, label], ...].
export function vbands(spans, color = "#f3a712") {
  return spans.map(([t0, t1]) => ({type: "rect", xref: "x", yref: "paper", x0: new Date(t0 * 1000), x1: new Date(t1 * 1000),
    y0: 0, y1: 1, fillcolor: color, opacity: 0.18, line: {width: 0}}));
}

// Plotly is 4.6 MB of script: evaluating it holds the main thread for half a second to two seconds on a slow or busy
// machine. The pages whose first screen is a chart preload it (<link rel="preload" as="script" id="plotly-src">) and
// run it with loadPlotly() once their own API requests are on the wire, so the server prepares the data while the
// browser evaluates plotly, instead of one after the other. A figure drawn before plotly is there waits for it (the
// newest per element); "cdx:plotly" is dispatched on window once those are drawn (handlers that need el.on).
let plotlyLoaded = null;
const waiting = new Map(); // element -> [call number, traces, layout, config]
const latest = new WeakMap(); // element -> number of the newest react() call for it
let calls = 0;
export function loadPlotly() {
  plotlyLoaded = plotlyLoaded || new Promise((resolve) => {
    const src = document.getElementById("plotly-src");
    if (window.Plotly || !src) { resolve(); return; }
    const tag = document.createElement("script");
    tag.src = src.href;
    tag.addEventListener("load", resolve, {once: true});
    tag.addEventListener("error", resolve, {once: true}); // the charts stay empty; the page's tables still work
    document.head.appendChild(tag);
  }).then(() => {
    performance.mark("cdx:plotly-ready"); // benchmarks/browser.py --timeline shows it
    // Each waiting figure in a task of its own, so the page's own first screen (drawn when it marks itself dirty on
    // this promise) is not held behind all of them; one redrawn since with newer data is not drawn stale.
    const queue = window.Plotly ? [...waiting] : [];
    waiting.clear();
    const next = () => {
      const item = queue.shift();
      if (!item) { window.dispatchEvent(new Event("cdx:plotly")); return; }
      const [el, [n, ...args]] = item;
      if (latest.get(el) === n) Plotly.react(el, ...args);
      setTimeout(next, 0);
    };
    setTimeout(next, 0);
  });
  return plotlyLoaded;
}

// Most pages load one of plotly's smaller bundles, basic or cartesian (data-gl="0" on #plotly-src: a fifth or a third
// of the full bundle's evaluation), which have no WebGL traces: theirs are drawn as SVG lines, which the server's
// downsampling keeps small.
const GL = document.getElementById("plotly-src")?.dataset.gl !== "0";
const drawable = (traces) => (GL ? traces : traces.map((t) => (t.type === "scattergl" ? {...t, type: "scatter"} : t)));

export function react(id, traces, lay, config = CONFIG) {
  const el = typeof id === "string" ? document.getElementById(id) : id;
  if (!el) return el;
  traces = drawable(traces);
  latest.set(el, ++calls);
  if (window.Plotly) Plotly.react(el, traces, lay, config);
  else { waiting.set(el, [calls, traces, lay, config]); loadPlotly(); }
  return el;
}
