// The finding page: the answer on top (rendered by the server, kept live here), then the evidence DRAWN the way its
// detector saw it — the series, the detector's window shaded, its threshold dashed, the worst point marked — the
// numbers, earlier findings on the subject and the alert deliveries. Everything comes from /api/v1/findings/{id}
// (the page's first data); the cluster stream says when this finding changes, and the page re-reads it then.
import {esc, fmt, when, age, link, $, pageData, getJSON} from "./lib/fmt.js";
import {connectLive} from "./lib/live.js";
import {COLORS, SEV_COLORS, layout, timeAxis, toDates, react} from "./lib/chart.js";

let data = pageData();
const ID = data.finding.id;
const API = `/api/v1/findings/${ID}`;
const ROLE_STYLE = {
  subject: {color: COLORS[1], width: 2.5},
  baseline: {color: "#6c757d", width: 1.5, dash: "dot"},
  context: {color: COLORS[3], width: 1.5},
};
const THRESHOLD_COLORS = ["#9d0208", "#f3a712", "#6c757d"];

// -- the answer ---------------------------------------------------------------------------------------------------
function renderAnswer() {
  const f = data.finding;
  $("f-severity").className = `sev ${f.severity}`;
  $("f-severity").textContent = f.severity;
  $("f-state").className = `pill state-${f.state}`;
  $("f-state").textContent = f.state;
  $("f-title").textContent = f.title;
  $("f-headline").textContent = f.headline || "";
  $("f-action").textContent = f.action || "";
  $("answer").className = `card answer finding-answer sev-border-${f.severity}${f.state === "resolved" ? " resolved" : ""}`;
  const w = data.chart.window;
  const facts = [
    ["opened", `${when(f.opened_at)} (${age(f.opened_at)} ago)`],
    ["updated", `<span id="f-updated">${esc(when(f.updated_at))}</span>`],
    ["resolved", f.resolved_at ? when(f.resolved_at) : "–"],
    ["last seen", f.last_seen_at ? when(f.last_seen_at) : "–"],
    ["confidence", `${Math.round(100 * f.confidence)}%`],
    ["detector window", w ? `${fmt(w[1] - w[0], 0)} s, ending ${when(w[1])}` : "–"],
    ["all findings", link(f.findings_url, `on ${f.cluster}`)],
  ];
  $("f-attention").innerHTML = attention(f);
  const ackForm = $("ack-form");
  if (ackForm) {
    ackForm.hidden = f.state !== "open";
    ackForm.elements.ack.value = f.acked_by ? "0" : "1";
    const button = ackForm.querySelector("button");
    button.id = f.acked_by ? "unack-button" : "ack-button";
    button.textContent = f.acked_by ? "Take the acknowledgement back" : "Acknowledge (no more alerts until it resolves)";
  }
  $("f-facts").innerHTML = facts.map(([k, v]) => `<div><dt>${esc(k)}</dt><dd>${k === "updated" || k === "all findings" ? v : esc(v)}</dd></div>`).join("");
}

// Who is on it, in words: the acknowledgement, and the silences that hold its alerts back (with their reasons).
function attention(f) {
  const out = [];
  if (f.acked_by) out.push(`<span class="pill acked">acknowledged</span> by ${esc(f.acked_by)} at ${esc(when(f.acked_at))}: no more alerts until it resolves.`);
  for (const s of data.silences || []) {
    out.push(`<span class="pill silenced">silenced</span> ${esc(s.scope)} ${esc(s.target)} until ${esc(when(s.ends_at))} by ${esc(s.by)}: ${esc(s.reason)}`);
  }
  if (!data.silences?.length && f.silenced) out.push(`<span class="pill silenced">silenced</span> until ${esc(when(f.silenced.until))} by ${esc(f.silenced.by)}: ${esc(f.silenced.reason)}`);
  return out.join("<br>");
}

// -- the evidence ---------------------------------------------------------------------------------------------------
const xval = (p, v) => (p.x === "time" ? new Date(v * 1000) : v);
const xs = (p, arr) => (p.x === "time" ? toDates(arr) : arr);

function panelTraces(p) {
  const bar = p.type === "bar";
  const traces = p.series.map((s) => {
    const st = ROLE_STYLE[s.role] || ROLE_STYLE.context;
    const t = {name: s.name, meta: s.role, x: xs(p, s.x), y: s.y, hovertemplate: "%{y:.4g}"};
    if (bar) return {...t, type: "bar", marker: {color: st.color}};
    return {...t, type: "scatter", mode: p.x === "step" && s.x.length <= 60 ? "lines+markers" : "lines",
      line: {color: st.color, width: st.width, dash: st.dash || "solid"}, marker: {size: 4}, connectgaps: false};
  });
  p.thresholds.forEach((th, i) => traces.push({
    type: "scatter", mode: "lines", name: th.name, meta: i === 0 ? "threshold" : "threshold-extra",
    x: xs(p, th.x), y: th.y, line: {color: THRESHOLD_COLORS[i % THRESHOLD_COLORS.length], dash: "dash", width: 1.8},
    hovertemplate: "%{y:.4g}",
  }));
  const b = p.breach;
  if (b) {
    traces.push({type: "scatter", mode: "markers", name: b.over ? `past the threshold` : "closest to the threshold",
      meta: "breach", x: [xval(p, b.x)], y: [b.y], marker: {symbol: "diamond", size: 13, color: b.over ? SEV_COLORS.critical : "#888",
        line: {color: "#fff", width: 1.5}}, hovertemplate: `%{y:.4g} vs ${b.threshold}<extra></extra>`});
  }
  return traces;
}

function panelLayout(p) {
  const shapes = [];
  const annotations = [];
  if (p.window && p.x !== "category") {
    shapes.push({type: "rect", xref: "x", yref: "paper", x0: xval(p, p.window[0]), x1: xval(p, p.window[1]), y0: 0, y1: 1,
      fillcolor: "#f3a712", opacity: 0.16, line: {width: 0}, layer: "below"});
    // Its label reads from the window's start, or, for a window at the newest end, ends at the window's end (a
    // label from the start of a narrow window there ran off the plot); and it sits on the side of the plot away from
    // the worst point's label (bad when above: the worst point is high, so the label goes to the bottom).
    const all = p.series.flatMap((s) => s.x).filter((v) => typeof v === "number");
    const atEnd = all.length && p.window[0] > (Math.min(...all) + Math.max(...all)) / 2;
    const top = p.direction === "below";
    annotations.push({xref: "x", yref: "paper", x: xval(p, p.window[atEnd ? 1 : 0]), y: top ? 1 : 0,
      text: "detector window", showarrow: false, xanchor: atEnd ? "right" : "left", yanchor: top ? "top" : "bottom",
      font: {size: 10, color: "#9a6a00"}, bgcolor: "rgba(255,255,255,.85)"});  // legible over the lines
  }
  for (const m of p.markers) {
    shapes.push({type: "line", xref: "x", yref: "paper", x0: xval(p, m.x), x1: xval(p, m.x), y0: 0, y1: 1,
      line: {color: "#8d6a9f", width: 1, dash: "dot"}});
    annotations.push({xref: "x", yref: "paper", x: xval(p, m.x), y: 0.02, text: esc(m.text), showarrow: false, textangle: -90,
      xanchor: "right", font: {size: 10, color: "#8d6a9f"}});
  }
  const b = p.breach;
  if (b) {
    const ratio = b.threshold ? ` (${fmt(b.y / b.threshold, 2)}× the threshold)` : "";
    // The label stays inside the plot: the worst point is usually in the detector window at the newest end, where a
    // label centred on it ran off the right edge; there it ends at the arrow instead, and starts at it near the left.
    const all = p.series.flatMap((s) => s.x).filter((v) => typeof v === "number");
    const right = all.length && b.x > (Math.min(...all) + Math.max(...all)) / 2;
    annotations.push({x: xval(p, b.x), y: b.y, text: `${fmt(b.y, 3)} vs ${fmt(b.threshold, 3)}${ratio}`, showarrow: true,
      arrowhead: 0, ax: right ? -30 : 30, ay: -28, xanchor: right ? "right" : "left",
      font: {size: 11, color: b.over ? SEV_COLORS.critical : "#555"}, bgcolor: "rgba(255,255,255,.85)"});
  }
  // Every time panel shares the finding's range: the same instant sits at the same place in each (Grafana's habit).
  const r = data.chart.range;
  const xaxis = p.x === "time" ? timeAxis({range: [new Date(r[0] * 1000), new Date(r[1] * 1000)]}) : {title: {text: p.x === "step" ? "step" : ""}, type: p.x === "category" ? "category" : "linear"};
  return layout({xaxis, yaxis: {title: {text: p.y_title || ""}, rangemode: p.direction === "below" ? "tozero" : "normal"},
    shapes, annotations, height: 300, margin: {l: 55, r: 10, t: 10, b: 80},
    hovermode: p.type === "bar" ? "closest" : "x unified", legend: {orientation: "h", y: -0.3, yanchor: "top"}});
}

function renderEvidence() {
  const c = data.chart;
  $("problems").innerHTML = c.problems.length ? `<ul class="problems">${c.problems.map((p) => `<li>${esc(p)}</li>`).join("")}</ul>` : "";
  const box = $("panels");
  if (!c.panels.length) {
    box.innerHTML = `<p class="empty">This finding rests on facts, not on a time series: see the numbers.</p>`;
    return;
  }
  const ids = c.panels.map((p) => `panel-${p.id}`);
  if (box.dataset.ids !== ids.join(",")) {
    box.innerHTML = c.panels.map((p) => `<div class="panel"><h3>${esc(p.title)}<span class="muted"> · bad when ${p.direction} the dashed line</span></h3>
      <div id="panel-${esc(p.id)}" class="chart small evidence-chart" data-direction="${esc(p.direction)}"></div></div>`).join("");
    box.dataset.ids = ids.join(",");
  }
  for (const p of c.panels) react(`panel-${p.id}`, panelTraces(p), panelLayout(p));
}

// -- tables -------------------------------------------------------------------------------------------------------------
// Evidence names its instants *_ts or last_heard (epoch seconds): shown as times, not as ten-digit numbers.
const isInstant = (name, v) => typeof v === "number" && v > 1e9 && /(_ts|^last_heard|\.ts)$/.test(name);

function shown(v, name = "") {
  if (v === null || v === undefined) return "–";
  if (isInstant(name, v)) return when(v);
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : fmt(v, Math.abs(v) < 10 ? 3 : 1);
  if (Array.isArray(v)) return v.length ? v.map((x) => (typeof x === "object" ? JSON.stringify(x) : String(x))).join(", ") : "–";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function renderNumbers() {
  const rows = data.chart.numbers.map((r) => `<tr><td>${esc(r.name)}</td><td class="num">${esc(shown(r.value, r.name))}</td></tr>`);
  const th = Object.entries(data.chart.thresholds).map(([k, v]) => `<tr class="threshold"><td>threshold: ${esc(k)}</td><td class="num">${esc(shown(v))}</td></tr>`);
  $("numbers").innerHTML = `<tbody>${rows.join("") + th.join("") || `<tr><td class="empty">No numbers stored.</td></tr>`}</tbody>`;
}

function renderEarlier() {
  const rows = data.earlier.map((e) => `<tr><td><span class="sev ${esc(e.severity)}">${esc(e.severity)}</span></td>
    <td>${link(e.url, e.title)}</td><td>${esc(e.kind)}</td><td class="state-${esc(e.state)}">${esc(e.state)}</td>
    <td>${esc(when(e.opened_at))}</td><td>${esc(when(e.resolved_at))}</td></tr>`);
  $("earlier").innerHTML = rows.length ? `<thead><tr><th></th><th>finding</th><th>kind</th><th>state</th><th>opened</th><th>resolved</th></tr></thead><tbody>${rows.join("")}</tbody>`
    : `<tbody><tr><td class="empty">None: the first time this subject was named.</td></tr></tbody>`;
}

function renderDeliveries() {
  const rows = data.deliveries.map((d) => `<tr class="delivery-${esc(d.status)}"><td>${link(d.endpoint_url, d.endpoint)} <span class="muted">${esc(d.endpoint_kind)}</span></td>
    <td>${esc(d.event)}</td><td><span class="pill status-${esc(d.status)}">${esc(d.status)}</span>${d.group ? ` <span class="muted">in #${esc(d.group)}</span>` : ""}</td>
    <td class="num">${esc(d.attempts)}/${esc(d.max_attempts)}</td><td class="num">${esc(d.response_code ?? "–")}</td>
    <td class="error-text">${esc(d.last_error || "")}</td><td>${esc(when(d.created_at))}</td><td>${esc(when(d.finished_at))}</td></tr>`);
  $("deliveries").innerHTML = rows.length ? `<thead><tr><th>endpoint</th><th>event</th><th>status</th><th class="num">attempts</th><th class="num">HTTP</th><th>last error</th><th>created</th><th>finished</th></tr></thead><tbody>${rows.join("")}</tbody>`
    : `<tbody><tr><td class="empty">No alert was sent for this finding (no endpoint wanted it).</td></tr></tbody>`;
}

function render() {
  renderAnswer();
  renderEvidence();
  renderNumbers();
  renderEarlier();
  renderDeliveries();
}

// -- live -----------------------------------------------------------------------------------------------------------------
let refetch = null;
function reload(delay = 500) {
  clearTimeout(refetch);
  refetch = setTimeout(async () => {
    try { data = await getJSON(API); render(); } catch (e) { console.warn(e); }
  }, delay);
}

function onFrame(frame) {
  const mine = (frame.findings || []).filter((r) => r.id === ID).pop();
  if (!mine) return;
  const changed = mine.state !== data.finding.state || mine.updated_at !== data.finding.updated_at ||
    mine.acked_by !== data.finding.acked_by || JSON.stringify(mine.silenced ?? null) !== JSON.stringify(data.finding.silenced ?? null);
  Object.assign(data.finding, mine);
  renderAnswer();
  if (changed) reload();
}

render();
connectLive(data.ws, onFrame);
// Evidence is refreshed by every pass while the finding is open; a quiet re-read keeps the chart current.
setInterval(() => { if (data.finding.state === "open" && !document.hidden) reload(0); }, 15000);
