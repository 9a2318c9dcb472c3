// The cluster overview: the answer (worst open findings) first, then a health map of every node and GPU (one plotly
// heatmap: a canvas, not a DOM element per GPU, so 2,048 nodes x 8 GPUs stay cheap), the findings, runs and events.
// First data comes rendered into the page (the overview API's answer); the websocket keeps GPUs, findings and events
// live, and the API is re-read every REFRESH_MS for node states and runs.
import {$, age, esc, fmt, getJSON, link, pageData, sevRank} from "./lib/fmt.js";
import {connectLive, drawLoop} from "./lib/live.js";
import {CONFIG, SEV_COLORS, layout, react} from "./lib/chart.js";

const REFRESH_MS = 12000;
const SEVS = ["info", "warning", "error", "critical"];
// Cell codes: 0..100 = a healthy GPU's utilisation; above, its worst finding, then stale / down (no numbers shown).
const CODE = {info: 101, warning: 102, error: 103, critical: 104, stale: 105, down: 106};
const UTIL_LO = "#eef4e8", UTIL_HI = "#2f6b3a";
const ZMAX = 106;
const p = (v) => v / ZMAX;
const step = (v, color) => [[p(v - 0.5), color], [p(v + 0.5), color]];
const SCALE = [[0, UTIL_LO], [p(100), UTIL_HI], [p(100.5), UTIL_HI],
  ...step(101, SEV_COLORS.info), ...step(102, SEV_COLORS.warning), ...step(103, SEV_COLORS.error),
  ...step(104, SEV_COLORS.critical), ...step(105, SEV_COLORS.stale), [p(105.5), SEV_COLORS.down], [1, SEV_COLORS.down]];

let ov = pageData();
const api = ov.cluster;
let nodes = [];            // the API's nodes, each with .gpuObjs and live bookkeeping
const byHost = new Map();
let fetchedAt = performance.now();
let lastDelta = 0;          // when any live GPU row last arrived (ms, performance clock)
const findings = new Map(); // id -> row
const events = new Map();   // key -> event, shown newest first
let eventsNext = null;
let grid = {cells: [], rows: 0};

const worst = (...s) => s.filter(Boolean).sort((a, b) => sevRank[b] - sevRank[a])[0] || null;
const evKey = (e) => `${Number(e.ts).toFixed(3)}|${e.host}|${e.kind}|${e.code}|${e.message}`;

function adopt(data) {
  ov = data;
  fetchedAt = performance.now();
  const cols = data.gpu_columns;
  const at = (name) => cols.indexOf(name);
  nodes = data.nodes;
  byHost.clear();
  for (const n of nodes) {
    byHost.set(n.host, n);
    n.arrived = fetchedAt - 1000 * (n.silent_s ?? 1e9);
    n.gpuObjs = n.gpus.map((g) => ({index: g[at("index")], util: g[at("util_gpu_pct")], temp: g[at("temp_c")],
      mem: g[at("mem_used_gib")], sev: g[at("severity")], state: g[at("state")], url: g[at("url")],
      arrived: g[at("state")] === "ok" ? fetchedAt : -Infinity}));
  }
  const live = new Map([...findings].filter(([, f]) => f.headline === undefined));
  findings.clear();
  for (const f of data.findings) findings.set(f.id, f);
  for (const [id, f] of live) if (!findings.has(id) && f.state === "open") findings.set(id, f);
  addEvents(data.events.events);
  if (eventsNext === null && data.events.next) eventsNext = data.events.next;
}

// -- state: the server's verdict, corrected by what the websocket shows since ----------------------------------------
function nodeState(n, now) {
  if (n.arrived > fetchedAt) return "ok";  // reports arrived after the verdict: it is alive
  const quiet = now - n.arrived > 1000 * ov.thresholds.stale_s;
  if (n.state === "ok" && quiet && now - lastDelta < 1000 * ov.thresholds.stale_s) return "stale";
  return n.state;
}

function gpuState(n, g, ns) {
  if (ns !== "ok") return ns;
  // A GPU whose rows stopped while its node's others arrive is stale on its own (a GPU that fell off the bus).
  if (g.arrived === -Infinity || g.util === null || n.arrived - g.arrived > 1000 * ov.thresholds.stale_s) return "stale";
  return "ok";
}

function cellCode(n, g, ns) {
  const st = gpuState(n, g, ns);
  if (st !== "ok") return CODE[st];
  const sev = worst(g.sev, n.node_severity);
  return sev ? CODE[sev] : Math.max(0, Math.min(100, g.util));
}

// -- the health map ----------------------------------------------------------------------------------------------------
function buildGrid() {
  const G = Math.max(1, ...nodes.map((n) => n.gpuObjs.length));
  const key = ov.group_by;
  const groups = [];
  for (const n of nodes) {
    const name = key ? (n[key] || `no ${key}`) : "";
    if (!groups.length || groups[groups.length - 1].name !== name) groups.push({name, nodes: []});
    groups[groups.length - 1].nodes.push(n);
  }
  const packed = nodes.length > 64;
  const per = packed ? (nodes.length > 512 ? 32 : 16) : 1;
  const width = packed ? per * (G + 1) - 1 : G;
  const cells = [], labels = [];
  for (const grp of groups) {
    if (key && !packed) { cells.push(Array(width).fill(null)); labels.push(`<b>${esc(grp.name)}</b>`); }
    for (let i = 0; i < grp.nodes.length; i += per) {
      const row = Array(width).fill(null);
      grp.nodes.slice(i, i + per).forEach((n, k) => n.gpuObjs.forEach((g, j) => { row[k * (G + 1) + j] = [n, g]; }));
      cells.push(row);
      labels.push(packed ? (i === 0 ? esc(grp.name) : "") : esc(grp.nodes[i].host));
    }
    if (key && packed) { cells.push(Array(width).fill(null)); labels.push(""); }
  }
  grid = {cells, labels, packed, G, width, groups: groups.length};
}

function drawMap() {
  if (!nodes.length) { $("healthmap").innerHTML = '<p class="empty">No node has reported yet.</p>'; return; }
  buildGrid();
  const now = performance.now();
  const states = new Map(nodes.map((n) => [n, nodeState(n, now)]));
  const z = grid.cells.map((row) => row.map((c) => (c ? cellCode(c[0], c[1], states.get(c[0])) : null)));
  const rowPx = grid.packed ? 7 : 22;
  const el = $("healthmap");
  el.dataset.cells = String(z.reduce((s, r) => s + r.filter((v) => v !== null).length, 0));
  const ticks = grid.labels.map((l, i) => [i, l]).filter(([, l]) => l);
  react(el, [{type: "heatmap", z, zmin: 0, zmax: ZMAX, colorscale: SCALE, showscale: false, hoverinfo: "none",
    xgap: grid.packed ? 0 : 2, ygap: 1}],
  layout({height: Math.max(120, rowPx * z.length + 40), margin: {l: grid.packed ? 90 : 110, r: 10, t: 6, b: grid.packed ? 6 : 24},
    hovermode: "closest", dragmode: false,
    xaxis: grid.packed ? {visible: false, fixedrange: true} :
      {tickvals: [...Array(grid.G).keys()], ticktext: [...Array(grid.G).keys()].map((i) => `GPU ${i}`), fixedrange: true,
        showgrid: false, zeroline: false},
    yaxis: {autorange: "reversed", tickvals: ticks.map((t) => t[0]), ticktext: ticks.map((t) => t[1]), fixedrange: true,
      showgrid: false, zeroline: false}}), CONFIG);
  if (!el.dataset.hooked && el.on) {
    el.dataset.hooked = "1";
    el.on("plotly_hover", (ev) => showTip(ev));
    el.on("plotly_unhover", () => { $("map-tip").hidden = true; });
    el.on("plotly_click", (ev) => openCell(ev));
  }
  drawSummary(states);
  drawTrouble(states);
}

function cellOf(pt) {
  const [r, c] = Array.isArray(pt.pointNumber) ? pt.pointNumber : [pt.y, pt.x];
  return (grid.cells[r] || [])[c] || null;
}

// The page of what the colour is about: the GPU when its own finding is the worst thing on it, else the node;
// shift-click opens the GPU when it has a page link (the API gives one to every GPU a finding names).
function targetOf(n, g, shift) {
  const own = g.sev && sevRank[g.sev] >= (n.node_severity ? sevRank[n.node_severity] : -1);
  return (shift || own) && g.url ? g.url : n.url;
}

function showTip(ev) {
  const pt = ev.points && ev.points[0];
  const c = pt && cellOf(pt);
  const tip = $("map-tip");
  if (!c) { tip.hidden = true; return; }
  const [n, g] = c;
  const ns = nodeState(n, performance.now());
  const st = gpuState(n, g, ns);
  const sev = worst(g.sev, n.node_severity);
  const nums = st === "ok" ? `util ${fmt(g.util, 0)}% · ${fmt(g.temp, 0)} °C · ${fmt(g.mem, 1)} GiB` : `no current numbers (${st})`;
  tip.innerHTML = `<b>${esc(n.host)}</b> GPU ${g.index}${n.rack ? ` · ${esc(n.rack)}` : ""}<br>${nums}<br>` +
    `node ${esc(ns)}${sev ? ` · <span class="sev ${esc(sev)}">${esc(sev)}</span>` : ""}` +
    `<br><span class="muted">click: ${targetOf(n, g, false) === g.url ? "GPU" : "node"} page</span>`;
  const e = ev.event || {};
  tip.style.left = `${(e.pageX || 0) + 14}px`;
  tip.style.top = `${(e.pageY || 0) + 14}px`;
  tip.hidden = false;
}

function openCell(ev) {
  const pt = ev.points && ev.points[0];
  const c = pt && cellOf(pt);
  if (c) location.href = targetOf(c[0], c[1], !!(ev.event && ev.event.shiftKey));
}

function drawSummary(states) {
  const count = {ok: 0, stale: 0, down: 0};
  let util = 0, busy = 0, gpus = 0;
  for (const n of nodes) {
    const ns = states.get(n);
    count[ns] += 1;
    for (const g of n.gpuObjs) {
      gpus += 1;
      if (gpuState(n, g, ns) === "ok" && g.util !== null) { util += g.util; busy += 1; }
    }
  }
  $("kpi-ok").textContent = count.ok;
  $("kpi-stale").textContent = count.stale;
  $("kpi-down").textContent = count.down;
  $("kpi-gpus").textContent = gpus;
  $("kpi-util").textContent = busy ? `${fmt(util / busy, 0)}%` : "–";
  $("kpi-findings").textContent = findings.size;
  $("summary").textContent = `${nodes.length} nodes${ov.group_by ? ` by ${ov.group_by}` : ""} · updated ${new Date().toLocaleTimeString()}`;
  $("map-caption").textContent = ov.group_by ? `(grouped by ${ov.group_by})` : "";
}

function drawTrouble(states) {
  const bad = nodes.filter((n) => states.get(n) !== "ok" || n.severity);
  const rank = (n) => (states.get(n) === "down" ? 10 : states.get(n) === "stale" ? 5 : 0) + (n.severity ? sevRank[n.severity] : -1);
  bad.sort((a, b) => rank(b) - rank(a) || a.host.localeCompare(b.host));
  const shown = bad.slice(0, 40).map((n) => {
    const ns = states.get(n);
    const gpus = n.gpuObjs.filter((g) => g.sev).map((g) => `<a class="sev ${esc(g.sev)}" href="${esc(g.url)}">GPU ${g.index}</a>`).join(" ");
    return `<li><a href="${esc(n.url)}">${esc(n.host)}</a> <span class="state ${esc(ns)}">${esc(ns)}</span>` +
      `${n.severity ? ` <span class="sev ${esc(n.severity)}">${esc(n.severity)}</span>` : ""} ${gpus}</li>`;
  });
  $("trouble").innerHTML = bad.length ? `<h3>Nodes needing attention (${bad.length})</h3><ul>${shown.join("")}</ul>` +
    (bad.length > 40 ? `<p class="muted">…and ${bad.length - 40} more</p>` : "") : "";
}

function drawLegend() {
  const util = `<span class="ramp" style="background:linear-gradient(90deg, ${UTIL_LO}, ${UTIL_HI})"></span> GPU util 0–100%`;
  const sw = (name, color) => `<span><i style="background:${color}"></i>${name}</span>`;
  $("map-legend").innerHTML = `<span>${util}</span>` + SEVS.map((s) => sw(s, SEV_COLORS[s])).join("") +
    sw("stale", SEV_COLORS.stale) + sw("down", SEV_COLORS.down);
}

// -- findings, runs, events ------------------------------------------------------------------------------------------
function sortedFindings() {
  return [...findings.values()].sort((a, b) => sevRank[b.severity] - sevRank[a.severity] || b.updated_at - a.updated_at);
}

function drawFindings() {
  const rows = sortedFindings();
  const body = $("findings").querySelector("tbody");
  body.innerHTML = rows.slice(0, 100).map((f) => `<tr data-id="${f.id}"><td><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span></td>` +
    `<td>${link(f.subject_url, f.subject)}</td><td>${link(f.url, f.title)}</td>` +
    `<td class="headline">${esc(f.headline ?? "")}</td><td class="num">${age(f.opened_at)}</td></tr>`).join("") ||
    '<tr><td colspan="5" class="empty">No open findings.</td></tr>';
  const top = rows.slice(0, 3);
  const counts = {ok: 0, stale: 0, down: 0};
  const now = performance.now();
  for (const n of nodes) counts[nodeState(n, now)] += 1;
  $("answer").innerHTML = top.length ? `<ol class="answer-list">${top.map((f) =>
    `<li><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span> ${link(f.url, f.title)} — ${link(f.subject_url, f.subject)}` +
    `${f.headline ? `<br><span class="muted">${esc(f.headline)}</span>` : ""}</li>`).join("")}</ol>` +
    (rows.length > 3 ? `<p class="muted">${rows.length - 3} more open below.</p>` : "") :
    `<p>No open findings. ${counts.ok} of ${nodes.length} nodes ok` +
    `${counts.down ? `, <b>${counts.down} down</b>` : ""}${counts.stale ? `, ${counts.stale} stale` : ""}.</p>`;
  document.getElementById("answer-card").classList.toggle("calm", !top.length && !counts.down);
}

function drawRuns() {
  const body = $("runs").querySelector("tbody");
  body.innerHTML = (ov.runs || []).map((r) => {
    const risk = r.at_risk;
    const going = r.state === "running";
    return `<tr><td>${link(r.url, r.name)}</td><td><span class="run-state ${esc(r.state)}">${esc(r.state)}</span></td>` +
      `<td class="num">${r.last_step ?? "–"}</td><td class="num ${going ? "" : "muted"}">${fmt(r.step_rate, 2)}</td>` +
      `<td class="num">${r.mfu === null ? "–" : `${fmt(100 * r.mfu, 1)}%`}</td>` +
      `<td class="num">${r.tokens_per_s === null ? "–" : Math.round(r.tokens_per_s).toLocaleString()}</td>` +
      `<td class="num">${risk ? usd(risk.usd) : "–"}</td>` +
      `<td class="muted">${risk ? `${risk.since === "start" ? "start (no checkpoint seen)" : `step ${risk.last_checkpoint_step}`}, ${fmt(risk.gpu_hours, 1)} GPU-h` : ""}</td></tr>`;
  }).join("") || '<tr><td colspan="8" class="empty">No runs reported yet.</td></tr>';
}

const usd = (v) => (v === null ? "–" : v < 100 ? `$${v.toFixed(2)}` : `$${Math.round(v).toLocaleString()}`);

function addEvents(rows) {
  for (const e of rows) {
    const k = evKey(e);
    if (events.has(k)) continue;
    const n = byHost.get(e.host);
    events.set(k, {...e, url: e.url ?? (n ? n.url : null)});
  }
}

function drawEvents() {
  const rows = [...events.values()].sort((a, b) => b.ts - a.ts);
  $("events").innerHTML = rows.map((e) => `<li class="sev-${esc(e.severity)}"><span class="muted">${new Date(e.ts * 1000).toLocaleTimeString()}</span> ` +
    `${e.host ? link(e.url, e.host) : ""}${e.gpu_url ? ` ${link(e.gpu_url, `GPU ${e.gpu_index}`)}` : ""} <b>${esc(e.kind)}</b>` +
    `${e.code !== null && e.code !== undefined ? ` ${esc(e.code)}` : ""}: ${esc(e.message)}</li>`).join("") ||
    '<li class="empty">No warnings or errors recorded.</li>';
  $("older").disabled = !eventsNext;
  const sevs = ["warning", "error", "critical"];
  react("timeline", sevs.map((s) => {
    const mine = rows.filter((e) => e.severity === s);
    return {type: "scatter", mode: "markers", name: s, x: mine.map((e) => new Date(e.ts * 1000)), y: mine.map(() => s),
      text: mine.map((e) => `${e.host || ""} ${e.kind}: ${String(e.message).slice(0, 120)}`), hoverinfo: "x+text",
      customdata: mine.map((e) => e.url), marker: {color: SEV_COLORS[s], size: 9, opacity: 0.8}};
  }), layout({height: 170, hovermode: "closest", showlegend: false, margin: {l: 70, r: 10, t: 6, b: 30},
    // At least the last quarter hour up to now, so one event is a point in time, not a microsecond-wide axis.
    xaxis: {type: "date", range: [new Date(Math.min(Date.now() - 900e3, ...rows.map((e) => e.ts * 1000 - 60e3))), new Date(Date.now() + 30e3)]},
    yaxis: {type: "category", categoryorder: "array", categoryarray: sevs, range: [-0.5, sevs.length - 0.5]}}));
  const el = $("timeline");
  if (!el.dataset.hooked && el.on) {  // a point opens its node's page
    el.dataset.hooked = "1";
    el.on("plotly_click", (ev) => { const url = ev.points && ev.points[0] && ev.points[0].customdata; if (url) location.href = url; });
  }
}

async function older() {
  if (!eventsNext) return;
  const q = new URLSearchParams({before: eventsNext.before, before_id: eventsNext.before_id, limit: 50});
  const page = await getJSON(`${api.events_api}?${q}`);
  addEvents(page.events);
  eventsNext = page.next;
  markLists();
}

// -- live ------------------------------------------------------------------------------------------------------------
function onGpus(rows) {
  const now = performance.now();
  for (const [host, index, , util, mem, , temp] of rows) {
    const n = byHost.get(host);
    if (!n) continue;  // a node the last overview did not know: the next refresh adds it
    const g = n.gpuObjs.find((x) => x.index === index);
    n.arrived = now;
    if (!g) continue;
    Object.assign(g, {util, temp, mem: mem === null ? null : mem / 2 ** 30, arrived: now});
  }
  lastDelta = now;
}

function onFindings(rows, snapshot) {
  for (const f of rows) {
    if (f.state !== "open") { findings.delete(f.id); continue; }
    const had = findings.get(f.id);
    findings.set(f.id, {...f, headline: had ? had.headline : undefined, age_s: had ? had.age_s : undefined});
  }
  if (snapshot) {
    const open = new Set(rows.map((f) => f.id));
    for (const id of [...findings.keys()]) if (!open.has(id) && rows.length < 100) findings.delete(id);
  }
}

// Redrawing the map costs about a millisecond per 100 cells on a modest laptop: once a second for a small cluster,
// every 3 s past 4,000 GPUs, so a 16,384-GPU map keeps the main thread mostly idle while live.
const gpuCount = (ov.nodes || []).reduce((n, node) => n + (node.gpus ? node.gpus.length : 0), 0);
const markMap = drawLoop(drawMap, gpuCount > 4000 ? 3000 : 1000);
const markLists = drawLoop(() => { drawFindings(); drawRuns(); drawEvents(); }, 500);

adopt(ov);
drawLegend();
$("older").addEventListener("click", () => older().catch(() => {}));
connectLive(api.live, (frame) => {
  if (frame.gpus) { onGpus(frame.gpus); markMap(); }
  if (frame.findings) { onFindings(frame.findings, frame.type === "snapshot"); markLists(); }
  if (frame.events) { addEvents(frame.events); markLists(); }
});
setInterval(async () => {
  try { adopt(await getJSON(api.overview_api)); markMap(); markLists(); } catch (err) { /* the next refresh retries */ }
}, REFRESH_MS);
setInterval(markMap, 3000);  // a node that goes quiet turns stale without any frame to say so
