// The node page and the GPU view (same script; the GPU view's facts carry `gpu`). The answer on top (open findings),
// then one row per concern on one shared time axis, the DCGM way: utilisation, memory, power vs its limit,
// temperature, SM clock vs its max, throttle bands, errors; then ports, host, NFS and probes. Live GPU points from the
// websocket are appended to the charts while the range ends now; events are prepended as they arrive.
import {esc, fmt, bytes, age, when, link, $, pageData, getJSON} from "./lib/fmt.js";
import {connectLive, drawLoop} from "./lib/live.js";
import {COLORS, layout, timeAxis, toDates, bandTraces, hline, loadPlotly, react} from "./lib/chart.js";
import {rangePicker, rangeQuery, isLive} from "./lib/range.js";
import {badges} from "./lib/attention.js";

const DATA = pageData();
let facts = DATA.facts;
const HOST = facts.node.host;
const GPU = facts.gpu; // null on the node page
const GIB = 1 / 2 ** 30;
const LIVE_FIELDS = ["util_gpu_pct", "mem_used_bytes", "power_w", "temp_c"]; // GPU_ROW[3..6]
const LIVE_MAX = 3600;
const REASON_COLORS = {};

let range = null;
let series = null; // the last /series answer
let live = {}; // gpu index -> {t: [], field: []}: websocket points newer than the series' last bucket
const gpuColor = (g) => COLORS[Number(g) % COLORS.length];
const sortedKeys = (o) => Object.keys(o || {}).sort((a, b) => Number(a) - Number(b) || a.localeCompare(b));

// -- facts: findings, GPUs, ranks, events -------------------------------------------------------------------------
function findingItem(f) {
  return `<li class="sev-${esc(f.severity)}"><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span>
    ${link(f.url, f.title)} ${f.state === "open" ? badges(f) : ""} <span class="muted">· ${link(f.subject_url, f.subject)} · ${esc(f.kind)} ·
    ${f.state === "open" ? "open " + age(f.opened_at) : "updated " + when(f.updated_at)}</span>
    ${f.action ? `<div class="action">${esc(f.action)}</div>` : ""}</li>`;
}

// Silence end times come as epoch seconds in the server-rendered list: shown in the reader's own time zone.
document.querySelectorAll("#node-silences .epoch").forEach((el) => { el.textContent = when(Number(el.dataset.ts)); });

function renderFindings() {
  const open = facts.findings.open;
  $("findings-open").innerHTML = open.length ? open.map(findingItem).join("") : `<li class="empty">Nothing open: no detector is firing ${GPU === null ? "on this node" : "on this GPU"}.</li>`;
  $("answer").classList.toggle("answer", open.length > 0);
  $("findings-past").innerHTML = facts.findings.past.map(findingItem).join("") || `<li class="empty">None.</li>`;
}

function renderFacts() {
  const n = facts.node;
  $("node-state").textContent = n.state;
  $("node-state").className = `pill state-${n.state}`;
  const cell = (label, html) => `<div><label>${label}</label><span>${html}</span></div>`;
  $("facts").innerHTML = cell("cluster", link(facts.cluster.url, facts.cluster.name)) + cell("node", link(n.url, n.host)) +
    cell("rack", esc(n.rack || "–")) + cell("switch", esc(n.switch || "–")) + (n.spine ? cell("spine", esc(n.spine)) : "") + cell("agent", esc(n.agent_id || "–")) +
    cell("last seen", `${age(n.last_seen)} ago`) + cell("GPUs", String(facts.gpus.length)) +
    cell("ranks now", String(facts.ranks.filter((r) => r.active).length));
}

function renderGpuTable() {
  const rows = facts.gpus.filter((g) => GPU === null || g.index === GPU).map((g) => {
    const l = g.latest || {};
    const pair = (a, b, unit = "") => (a === null || a === undefined) ? "–" : `${fmt(a, 0)}${b ? " / " + fmt(b, 0) : ""}${unit}`;
    const bad = (l.pcie_width !== null && l.pcie_width < l.pcie_width_max) || (l.pcie_gen !== null && l.pcie_gen < l.pcie_gen_max);
    return `<tr><td>${link(g.url, "GPU " + g.index)}</td><td>${esc(g.name)}</td><td class="mono">${esc(g.uuid)}</td><td class="mono">${esc(g.pci_bus_id)}</td>
      <td class="num">${fmt(l.util_gpu_pct, 0)} %</td><td class="num">${bytes(l.mem_used_bytes)} / ${bytes(l.mem_total_bytes)}</td>
      <td class="num">${fmt(l.temp_c, 0)} °C</td><td class="num">${pair(l.power_w, l.power_limit_w, " W")}</td>
      <td class="num">${pair(l.sm_clock_mhz, l.sm_clock_max_mhz, " MHz")}</td>
      <td class="num ${bad ? "bad" : ""}">gen ${pair(l.pcie_gen, l.pcie_gen_max)} · x${pair(l.pcie_width, l.pcie_width_max)}</td>
      <td class="num">${pair(l.ecc_dbe_aggregate)}</td><td>${l.remap_pending ? '<span class="sev warning">pending</span>' : "–"}</td>
      <td class="num">${g.open_findings ? `<span class="sev error">${g.open_findings}</span>` : "0"}</td></tr>`;
  });
  $("gpu-table").innerHTML = rows.length ? `<table class="data"><tr><th>GPU</th><th>name</th><th>UUID</th><th>PCI</th><th class="num">util</th>
    <th class="num">memory</th><th class="num">temp</th><th class="num">power / limit</th><th class="num">SM clock / max</th>
    <th class="num">PCIe now / max</th><th class="num">DBE (agg)</th><th>remap</th><th class="num">open findings</th></tr>${rows.join("")}</table>`
    : `<p class="empty">No GPU reported yet.</p>`;
}

function renderRanks() {
  const el = $("ranks");
  if (!el) return;
  const rows = facts.ranks.map((r) => `<tr class="${r.active ? "" : "muted"}"><td>${link(r.run_url, r.run_name)}</td><td>${link(r.url, "rank " + r.rank)}</td>
    <td>${r.gpu_index === null ? "–" : link(facts.gpus.find((g) => g.index === r.gpu_index)?.url, "GPU " + r.gpu_index)}</td>
    <td class="num">${r.last_step ?? "–"}</td><td>${r.active ? "running" : "last step " + age(r.last_step_at) + " ago"}</td></tr>`);
  el.innerHTML = rows.length ? `<table class="data"><tr><th>run</th><th>rank</th><th>GPU</th><th class="num">last step</th><th>state</th></tr>${rows.join("")}</table>`
    : `<p class="empty">No ranks have run here.</p>`;
}

function eventRow(e) {
  const x = e.xid ? `<div class="xid"><b>Xid ${e.code} ${esc(e.xid.name)}</b>: ${esc(e.xid.meaning)}<div class="action">${esc(e.xid.action)}</div></div>` : "";
  const gpu = e.gpu_index === null || e.gpu_index === undefined ? "" : link(e.gpu_url, "GPU " + e.gpu_index);
  return `<tr class="sev-${esc(e.severity)}"><td>${when(e.ts)}</td><td><span class="sev ${esc(e.severity)}">${esc(e.severity)}</span> ${esc(e.kind)}</td>
    <td>${gpu}</td><td>${x}<span class="msg">${esc(e.message)}</span></td></tr>`;
}

function renderEvents() {
  $("events").innerHTML = facts.events.length ? `<table class="data"><tr><th>when</th><th>kind</th><th>GPU</th><th>what</th></tr>${facts.events.map(eventRow).join("")}</table>`
    : `<p class="empty">No events from this ${GPU === null ? "node" : "GPU"}.</p>`;
}

function renderGpuHealth() {
  const el = $("gpu-health");
  if (!el) return;
  const l = (facts.gpus.find((g) => g.index === GPU) || {}).latest || {};
  const v = (x) => (x === null || x === undefined) ? "–" : (typeof x === "boolean" ? (x ? "yes" : "no") : esc(x));
  const rows = [["ECC single-bit, volatile / aggregate", `${v(l.ecc_sbe_volatile)} / ${v(l.ecc_sbe_aggregate)}`],
    ["ECC double-bit, volatile / aggregate", `${v(l.ecc_dbe_volatile)} / ${v(l.ecc_dbe_aggregate)}`],
    ["Retired pages: single-bit / double-bit / pending", `${v(l.retired_pages_sbe)} / ${v(l.retired_pages_dbe)} / ${v(l.retired_pages_pending)}`],
    ["Row remaps: correctable / uncorrectable", `${v(l.remap_correctable)} / ${v(l.remap_uncorrectable)}`],
    ["Row remap pending / failed", `${v(l.remap_pending)} / ${v(l.remap_failure)}`],
    ["PCIe replays", v(l.pcie_replay_total)], ["PCIe gen now / max", `${v(l.pcie_gen)} / ${v(l.pcie_gen_max)}`],
    ["PCIe width now / max", `x${v(l.pcie_width)} / x${v(l.pcie_width_max)}`],
    ["NVLink links up / total", `${v(l.nvlink_links_up)} / ${v(l.nvlink_links_total)}`],
    ["NVLink CRC / replay / recovery errors", `${v(l.nvlink_crc_errors_total)} / ${v(l.nvlink_replay_errors_total)} / ${v(l.nvlink_recovery_errors_total)}`]];
  const na = Object.entries(l.unavailable || {}).map(([k, why]) => `<tr><td>${esc(k)}</td><td class="muted">${esc(why)}</td></tr>`).join("");
  const xids = facts.events.filter((e) => e.xid);
  el.innerHTML = `<div class="grid"><table class="data">${rows.map(([a, b]) => `<tr><th>${a}</th><td class="num">${b}</td></tr>`).join("")}${na}</table>
    <div><h3>Xid events on this GPU</h3>${xids.length ? `<table class="data">${xids.map(eventRow).join("")}</table>` : '<p class="empty">No Xid.</p>'}</div></div>`;
}

// The agent's interface list: usable ones first (loopback last among them), the down ones after, flagged.
const IFACE_DOWN = new Set(["down", "lowerlayerdown", "notpresent", "dormant"]);
function renderInterfaces() {
  const el = $("iface-table");
  if (!el) return;
  const got = facts.interfaces;
  if (!got || !got.items.length) { el.innerHTML = `<p class="empty">The agent reports no interface list (an agent older than this server, or sys_net = "").</p>`; return; }
  const rank = (i) => (IFACE_DOWN.has(i.state) ? 2 : i.kind === "loopback" ? 1 : 0);
  const items = [...got.items].sort((a, b) => rank(a) - rank(b) || a.name.localeCompare(b.name));
  const kind = (i) => ({ether: "Ethernet", infiniband: "IPoIB", loopback: "loopback"}[i.kind] || i.kind || "–") + (i.virtual && i.kind !== "loopback" ? " · virtual" : "");
  const speed = (m) => (!m ? "–" : m >= 1000 ? `${fmt(m / 1000, 0)} Gbit/s` : `${m} Mbit/s`);
  const rows = items.map((i) => `<tr><td class="mono">${esc(i.name)}</td>
    <td>${IFACE_DOWN.has(i.state) ? `<span class="sev error">${esc(i.state)}</span>` : esc(i.state || "–")}</td>
    <td class="mono">${(i.addresses || []).map(esc).join("<br>") || "–"}</td><td>${esc(kind(i))}</td>
    <td class="num">${i.mtu ?? "–"}</td><td class="num">${speed(i.speed_mbps)}</td></tr>`);
  el.innerHTML = `<table class="data"><tr><th>name</th><th>state</th><th>addresses</th><th>kind</th><th class="num">MTU</th><th class="num">speed</th></tr>${rows.join("")}</table>
    <p class="muted">reported ${age(got.reported_at)} ago</p>`;
}

function renderAllFacts() {
  renderFindings(); renderFacts(); renderGpuTable(); renderRanks(); renderEvents(); renderGpuHealth(); renderInterfaces();
}

// -- charts -------------------------------------------------------------------------------------------------------
function xRange() {
  const r = series.range;
  const to = isLive(range) ? Math.max(r.to, Date.now() / 1000) : r.to;
  return [new Date((to - (r.to - r.from)) * 1000), new Date(to * 1000)];
}

// Browsers allow ~16 WebGL contexts per page and plotly takes one per WebGL chart: only the five dense per-GPU rows
// draw with scattergl; the small charts (counters, host, ports, probes) are SVG.
const WEBGL_CHARTS = new Set(["chart-util", "chart-mem", "chart-power", "chart-temp", "chart-clock"]);
const SVG_MAX_POINTS = 20000;

// Utilisation is drawn at once, the rest of the first screen (memory, power, temperature) in the tasks right after
// it, then every other chart in a task of its own: the page paints its answer without waiting for twenty plots, and
// stays responsive while the rest come in (a plot costs ~50-400 ms of main thread, the most where the browser
// renders WebGL in software).
const FIRST = "chart-util";
const FIRST_SCREEN = new Set(["chart-mem", "chart-power", "chart-temp"]);
const soon = new Map(); // id -> draw, for the first screen: the newest wins when a chart is redrawn before its turn
const later = new Map(); // the same for every other chart, after those
function pump() {
  const queue = soon.size ? soon : later;
  const [id, draw] = queue.entries().next().value || [];
  if (!id) return;
  queue.delete(id);
  draw();
  if (soon.size || later.size) setTimeout(pump, 0);
}

// A live frame redraws only the charts in view: each one out of view keeps its newest figure and draws it when it is
// scrolled to (five SVG rows of eight GPUs and their bands, redrawn every second, held the main thread ~60 % of the
// time at 64 nodes; most of them are below the first screen).
const inView = new Map(); // chart id -> whether it is on (or within 300 px of) the screen, once the observer has said
const outOfView = new Map(); // chart id -> its newest draw, not yet done
const viewer = new IntersectionObserver((entries) => {
  for (const e of entries) {
    inView.set(e.target.id, e.isIntersecting);
    const pending = e.isIntersecting && outOfView.get(e.target.id);
    if (pending) { outOfView.delete(e.target.id); pending(); }
  }
}, {rootMargin: "300px 0px"});
for (const id of [FIRST, ...FIRST_SCREEN]) if ($(id)) viewer.observe($(id)); // the rows live frames grow

function chart(id, traces, yTitle, extra = {}, liveOnly = false) {
  if (liveOnly && inView.get(id) === false) { outOfView.set(id, () => drawChart(id, traces, yTitle, extra)); return; }
  outOfView.delete(id);
  if (id === FIRST) { drawChart(id, traces, yTitle, extra); return; }
  if (!soon.size && !later.size) setTimeout(pump, 0);
  (FIRST_SCREEN.has(id) ? soon : later).set(id, () => drawChart(id, traces, yTitle, extra));
}

function drawChart(id, traces, yTitle, extra) {
  const el = $(id);
  if (!el) return;
  // WebGL pays a context per chart (hundreds of ms where the browser renders it in software); SVG pays per point.
  // So WebGL only where a chart holds more points than SVG draws quickly.
  const points = traces.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
  if (!WEBGL_CHARTS.has(id) || points < SVG_MAX_POINTS) traces = traces.map((t) => (t.type === "scattergl" ? {...t, type: "scatter"} : t));
  const lim = extra.limits || [];
  const lay = layout({xaxis: timeAxis({range: xRange()}), yaxis: {title: {text: yTitle}, rangemode: "tozero", ...(extra.yaxis || {})},
    shapes: lim.map((h) => h.shape), annotations: lim.map((h) => h.annotation), showlegend: traces.length > 1 && traces.length <= 24,
    ...(extra.layout || {})});
  if (!traces.length) lay.annotations.push({xref: "paper", yref: "paper", x: 0.5, y: 0.5, text: extra.empty || "no data in this range", showarrow: false});
  react(el, traces, lay);
  el.dataset.points = String(points);
}

// A GPU's series with the live points appended (only the live fields grow; the others keep their buckets).
function withLive(key, s) {
  const lv = live[key];
  if (!lv || !lv.t.length) return s;
  // A silence between the stored buckets and the live points is a gap in the line, not a slope across it.
  const gap = s.t.length && lv.t[0] - s.t[s.t.length - 1] > 3 * series.range.bucket_s + 2;
  const t = gap ? s.t.concat([s.t[s.t.length - 1] + series.range.bucket_s], lv.t) : s.t.concat(lv.t);
  const out = {...s, t};
  for (const f of LIVE_FIELDS) {
    const base = s[f] || {min: s.t.map(() => null), mean: s.t.map(() => null), max: s.t.map(() => null)};
    const add = gap ? [null].concat(lv[f]) : lv[f];
    out[f] = {min: base.min.concat(add), mean: base.mean.concat(add), max: base.max.concat(add)};
  }
  return out;
}

// Few points (a short history, the first live seconds) get markers too: a lone point of a line draws nothing.
function perGpu(field, opts = {}) {
  return sortedKeys(series.gpus).flatMap((k) => bandTraces(withLive(k, series.gpus[k]), field, `GPU ${k}`, gpuColor(k), opts))
    .map((t) => (t.type === "scattergl" && t.x.length < 120 ? {...t, mode: "lines+markers", marker: {size: 3, color: t.line.color}} : t));
}

function lastOf(arr) {
  for (let i = arr.length - 1; i >= 0; i -= 1) if (arr[i] !== null) return arr[i];
  return null;
}

// A limit (power cap, max clock, total memory): one labelled dashed line when every GPU agrees, else a dashed trace per GPU.
function limitLines(field, label, scale = 1) {
  const keys = sortedKeys(series.gpus).filter((k) => series.gpus[k][field]);
  const vals = keys.map((k) => series.gpus[k][field].max);
  const all = new Set(vals.flat().filter((v) => v !== null));
  if (!all.size) return {limits: [], traces: []};
  if (all.size === 1) {
    const v = [...all][0];
    return {limits: [hline(v * scale, `${label} ${fmt(v * scale, scale === 1 ? 0 : 1)}`)], traces: []};
  }
  return {limits: [], traces: keys.map((k, i) => ({type: "scattergl", mode: "lines", name: `GPU ${k} ${label}`, x: toDates(series.gpus[k].t),
    y: vals[i].map((v) => (v === null ? null : v * scale)), line: {color: gpuColor(k), dash: "dash", width: 1}, showlegend: false}))};
}

function counterTraces(fields, names, stat = "max") {
  return sortedKeys(series.gpus).flatMap((k) => fields.filter((f) => series.gpus[k][f]).map((f, i) => ({
    type: "scattergl", mode: "lines", name: `GPU ${k} ${names[fields.indexOf(f)]}`, x: toDates(series.gpus[k].t),
    y: series.gpus[k][f][stat], line: {color: gpuColor(k), width: 1.5, dash: i ? "dot" : "solid"}})));
}

function throttleChart() {
  const traces = [];
  for (const k of sortedKeys(series.throttle)) {
    for (const [reason, spans] of Object.entries(series.throttle[k])) {
      if (!REASON_COLORS[reason]) REASON_COLORS[reason] = COLORS[(Object.keys(REASON_COLORS).length + 1) % COLORS.length];
      const x = [], y = [];
      for (const [a, b] of spans) { x.push(new Date(a * 1000), new Date(b * 1000), null); y.push(`GPU ${k} · ${reason}`, `GPU ${k} · ${reason}`, null); }
      traces.push({type: "scatter", mode: "lines", x, y, name: reason, legendgroup: reason, showlegend: false,
        line: {color: REASON_COLORS[reason], width: 12}, hovertemplate: `GPU ${k} ${reason}<extra></extra>`});
    }
  }
  const el = $("chart-throttle");
  el.style.height = `${Math.max(120, 60 + 26 * traces.length)}px`;
  chart("chart-throttle", traces, "", {yaxis: {type: "category", rangemode: "normal", automargin: true, visible: traces.length > 0},
    layout: {showlegend: false, margin: {l: 10, r: 10, t: 10, b: 35}}, empty: "no throttling in this range"});
}

// The rows live points grow: redrawn on every live frame (at most every 500 ms), the rest only on a new range.
function drawLiveCharts(liveOnly) {
  chart("chart-util", perGpu("util_gpu_pct"), "utilisation (%)", {yaxis: {range: [0, 105]}}, liveOnly);
  const mem = limitLines("mem_total_bytes", "total GiB", GIB);
  chart("chart-mem", perGpu("mem_used_bytes", {scale: GIB}).concat(mem.traces), "memory used (GiB)", {limits: mem.limits}, liveOnly);
  const pw = limitLines("power_limit_w", "limit W");
  chart("chart-power", perGpu("power_w").concat(pw.traces), "power (W)", {limits: pw.limits}, liveOnly);
  chart("chart-temp", perGpu("temp_c"), "temperature (°C)", {}, liveOnly);
}

function drawGpuCharts() {
  const clk = limitLines("sm_clock_max_mhz", "max MHz");
  chart("chart-clock", perGpu("sm_clock_mhz").concat(clk.traces), "SM clock (MHz)", {limits: clk.limits});
  throttleChart();
  // Colour = GPU (as in the rows above), solid / dotted = which counter: the hover names each line.
  const small = {layout: {margin: {l: 50, r: 10, t: 10, b: 30}, showlegend: false}};
  chart("chart-ecc-sbe", counterTraces(["ecc_sbe_volatile", "ecc_sbe_aggregate"], ["SBE vol", "SBE agg"]), "errors (count)", small);
  chart("chart-ecc-dbe", counterTraces(["ecc_dbe_volatile", "ecc_dbe_aggregate"], ["DBE vol", "DBE agg"]), "errors (count)", small);
  chart("chart-remap", counterTraces(["retired_pages_sbe", "retired_pages_dbe", "remap_correctable", "remap_uncorrectable"],
    ["retired SBE", "retired DBE", "remap corr", "remap uncorr"]), "pages / rows (count)", small);
  chart("chart-pcie", counterTraces(["pcie_replay_total"], ["replays"]), "replays (count)", small);
  const width = limitLines("pcie_width_max", "max width");
  chart("chart-pcie-link", counterTraces(["pcie_width", "pcie_gen"], ["width (lanes)", "gen"], "min").concat(width.traces),
    "lanes · gen", {...small, limits: width.limits});
  chart("chart-nvlink", counterTraces(["nvlink_crc_errors_total", "nvlink_replay_errors_total", "nvlink_recovery_errors_total"],
    ["CRC", "replay", "recovery"]), "errors (count)", small);
}

function line(s, field, name, color, opts = {}) {
  return s && s[field] ? bandTraces(s, field, name, color, opts) : [];
}

function drawNodeCharts() {
  if (GPU !== null) return;
  const small = {layout: {margin: {l: 55, r: 10, t: 10, b: 30}, legend: {orientation: "h", y: -0.25}}};
  const ports = series.ports || {};
  const pk = Object.keys(ports).sort();
  chart("chart-port-traffic", pk.flatMap((k, i) => line(ports[k], "xmit_bytes_per_s", `${k} xmit`, COLORS[2 * i % 16])
    .concat(line(ports[k], "rcv_bytes_per_s", `${k} rcv`, COLORS[(2 * i + 1) % 16]))), "bytes/s", small);
  chart("chart-port-errors", pk.flatMap((k, i) => Object.entries(ports[k].counters || {}).map(([c, s], j) => ({type: "scattergl",
    mode: "lines", name: `${k} ${c}`, x: toDates(ports[k].t), y: s.mean, line: {color: COLORS[(i * 5 + j + 1) % 16], width: 1.5}}))),
    "count per interval", small);
  const h = series.host || {};
  const hs = h.t ? h : null;
  chart("chart-cpu", line(hs, "cpu_pct", "CPU %", COLORS[0]).concat(line(hs, "load1", "load1", COLORS[1], {band: false})), "CPU (%) · load", small);
  const total = hs && hs.mem_total_bytes ? lastOf(hs.mem_total_bytes.max) : null;
  chart("chart-hostmem", line(hs, "mem_used_bytes", "used", COLORS[0], {scale: GIB}), "memory (GiB)",
    {...small, limits: total ? [hline(total * GIB, `total ${fmt(total * GIB, 0)} GiB`)] : []});
  chart("chart-disk", line(hs, "disk_read_bytes_per_s", "read", COLORS[3]).concat(line(hs, "disk_write_bytes_per_s", "write", COLORS[1])), "bytes/s", small);
  chart("chart-net", line(hs, "net_rx_bytes_per_s", "rx", COLORS[3]).concat(line(hs, "net_tx_bytes_per_s", "tx", COLORS[1])), "bytes/s", small);
  chart("chart-nfs", Object.keys(series.nfs || {}).sort().flatMap((m, i) => line(series.nfs[m], "rtt_ms", m, COLORS[i % 16])), "RTT (ms)", small);
  const p = series.probes || {all: {}, series: {}};
  const probeTraces = (field) => ["out", "in"].flatMap((side, i) => line(p.all[side], field, side === "out" ? "to peers (all)" : "from peers (all)", COLORS[i]))
    .concat(Object.keys(p.series).sort().map((key, i) => {
      const [side, peer] = key.split("|");
      const s = p.series[key];
      return {type: "scattergl", mode: "lines", name: `${side === "out" ? "→" : "←"} ${peer}`, x: toDates(s.t), y: s[field] ? s[field].mean : [],
        line: {color: COLORS[(i + 2) % 16], width: 1}, visible: "legendonly"};
    }));
  chart("chart-rtt", probeTraces("rtt_ms"), "RTT (ms)", small);
  chart("chart-bw", probeTraces("bw_gbps"), "bandwidth (Gbit/s)", small);
}

function renderSeriesTables() {
  if (GPU !== null) return;
  const rows = facts.ports.map((p) => {
    const s = (series.ports || {})[p.key];
    const errs = s ? Object.keys(s.counters || {}).join(", ") : "";
    return `<tr><td>${esc(p.key)}</td><td class="${p.state === "ACTIVE" ? "" : "bad"}">${esc(p.state || "–")} / ${esc(p.phys_state || "–")}</td>
      <td class="num">${fmt(p.rate_gbps, 0)} Gbit/s</td><td>${esc(p.link_layer || "–")}</td><td>${errs ? `<span class="bad">${esc(errs)}</span>` : "none"}</td></tr>`;
  });
  $("port-table").innerHTML = rows.length ? `<table class="data"><tr><th>port</th><th>state / phys</th><th class="num">rate</th><th>layer</th><th>error counters moving</th></tr>${rows.join("")}</table>`
    : `<p class="empty">No IB/RoCE port reported.</p>`;
  const peers = (series.probes || {}).peers || [];
  $("peer-table").innerHTML = peers.length ? `<table class="data"><tr><th>direction</th><th>peer</th><th>link</th><th class="num">RTT mean / max</th>
    <th class="num">bandwidth mean / min</th><th class="num">loss max</th></tr>${peers.map((r) => `<tr><td>${r.direction === "out" ? "to" : "from"}</td>
    <td>${link(r.url, r.peer)}</td><td>${link(r.link_url, "link")}</td><td class="num">${fmt(r.rtt_ms, 3)} / ${fmt(r.rtt_max_ms, 3)} ms</td>
    <td class="num">${fmt(r.bw_gbps, 1)} / ${fmt(r.bw_min_gbps, 1)} Gbit/s</td><td class="num ${r.loss_max_pct ? "bad" : ""}">${fmt(r.loss_max_pct, 0)} %</td></tr>`).join("")}</table>`
    : `<p class="empty">No probes in this range.</p>`;
}

let everything = true; // a new range redraws every chart; a live frame only the four rows it grows
function draw() {
  if (!series || !window.Plotly) return false; // loadPlotly() below marks the page dirty once plotly has run
  performance.mark("cdx:draw");
  drawLiveCharts(!everything);
  if (everything) { everything = false; drawGpuCharts(); drawNodeCharts(); }
}
const markDirty = drawLoop(draw, 500);

// -- data ---------------------------------------------------------------------------------------------------------
function points() {
  return Math.max(200, Math.min(1500, Math.round(window.innerWidth || 1200)));
}

async function loadSeries() {
  const gpu = GPU === null ? "" : `&gpu=${GPU}`;
  series = await getJSON(`${DATA.api.series}?${rangeQuery(range)}&points=${points()}${gpu}`);
  performance.mark("cdx:series");
  const fresh = {};
  for (const [k, lv] of Object.entries(live)) { // keep live points newer than the last bucket the server sent
    const s = series.gpus[k];
    const last = s && s.t.length ? s.t[s.t.length - 1] + series.range.bucket_s : 0;
    const keep = lv.t.map((t, i) => (t >= last ? i : -1)).filter((i) => i >= 0);
    fresh[k] = {t: keep.map((i) => lv.t[i]), ...Object.fromEntries(LIVE_FIELDS.map((f) => [f, keep.map((i) => lv[f][i])]))};
  }
  live = fresh;
  renderSeriesTables();
  everything = true;
  markDirty();
  document.body.dataset.seriesLoaded = String(Number(document.body.dataset.seriesLoaded || 0) + 1);
}

let factsTimer = null;
function refreshFactsSoon() {
  if (factsTimer) return;
  factsTimer = setTimeout(async () => {
    factsTimer = null;
    facts = await getJSON(DATA.api.facts);
    renderAllFacts();
  }, 1000);
}

function onGpuRows(rows) {
  if (!series || !isLive(range)) return;
  for (const row of rows) {
    const [host, idx, ts, ...vals] = row;
    if (host !== HOST || (GPU !== null && idx !== GPU)) continue;
    const s = series.gpus[idx];
    const lastBucket = s && s.t.length ? s.t[s.t.length - 1] : -Infinity;
    const lv = live[idx] || (live[idx] = {t: [], ...Object.fromEntries(LIVE_FIELDS.map((f) => [f, []]))});
    const lastLive = lv.t.length ? lv.t[lv.t.length - 1] : -Infinity;
    if (ts <= lastBucket || ts <= lastLive) continue; // the snapshot repeats what the series already has
    if (!series.gpus[idx]) series.gpus[idx] = {t: []};
    lv.t.push(ts);
    LIVE_FIELDS.forEach((f, i) => lv[f].push(vals[i]));
    if (lv.t.length > LIVE_MAX) { lv.t.shift(); LIVE_FIELDS.forEach((f) => lv[f].shift()); }
    markDirty();
  }
}

function onFrame(frame) {
  if (frame.gpus) onGpuRows(frame.gpus);
  if (frame.type === "delta" && frame.events && frame.events.length) {
    const mine = frame.events.filter((e) => e.host === HOST && (GPU === null || e.gpu_index === null || e.gpu_index === GPU));
    if (mine.length) { // show them now; the refresh brings each Xid's meaning and action
      facts.events = mine.slice().reverse().map((e) => ({...e, gpu_url: null})).concat(facts.events);
      renderEvents();
      refreshFactsSoon();
    }
  }
  // A link's finding names this node as either end: the list below shows both (node.py's _findings)
  if (frame.type === "delta" && (frame.findings || []).some((f) => f.node === HOST || f.peer_node === HOST)) refreshFactsSoon();
}

range = rangePicker($("range"), (r) => { range = r; live = {}; loadSeries(); });
loadSeries(); // on the wire first: the tables below take a few hundred ms to render on a busy machine
renderAllFacts();
connectLive(facts.live.ws, onFrame);
loadPlotly().then(markDirty); // after the requests above are on the wire: the server works while plotly evaluates
// A live range slides: the server's buckets are refetched every minute so the left edge and the rollups follow.
setInterval(() => { if (isLive(range)) loadSeries(); }, 60_000);
setInterval(() => { if (isLive(range)) markDirty(); }, 5_000);
