// The cluster overview: the answer (worst open findings) first, then a health map of every node and GPU (one canvas,
// not a DOM element per GPU, so 2,048 nodes x 8 GPUs stay cheap), the findings, runs and events. First data comes
// rendered into the page (the overview API's answer); the websocket keeps GPUs, findings and events live, and the API
// is re-read every REFRESH_MS for node states and runs. Plotly (the events timeline only) loads after the map's
// first paint.
import {$, age, esc, fmt, getJSON, link, pageData, sevRank} from "./lib/fmt.js";
import {connectLive, drawLoop} from "./lib/live.js";
import {SEV_COLORS, layout, loadPlotly, react} from "./lib/chart.js";
import {badges} from "./lib/attention.js";

const REFRESH_MS = 12000;
const SEVS = ["info", "warning", "error", "critical"];
// Cell codes: 0..100 = a healthy GPU's utilisation; above, its worst finding, then stale / down (no numbers shown).
const CODE = {info: 101, warning: 102, error: 103, critical: 104, stale: 105, down: 106};
const UTIL_LO = "#eef4e8", UTIL_HI = "#2f6b3a";

// Plotly (the events timeline only) runs after the health map's first paint: the page only preloads it
// (<link rel="preload" id="plotly-src">), since parsing it holds the main thread for a second or more on a slow
// machine, which must not come before the answer.
let plotlyAsked = false;
const afterFirstPaint = () => { if (!plotlyAsked) { plotlyAsked = true; setTimeout(() => loadPlotly().then(() => markLists()), 0); } };
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
  allKnown = data.findings.length >= data.summary.findings;
  if (allKnown && live.size) remark([]);  // opened after the server read its marks: on the map as in the list
}

// -- the map's marks between refreshes -------------------------------------------------------------------------------
// A node's and each GPU's colour is its worst open finding. The API's marks are as of its read; the websocket's
// findings keep them current by the server's rule (overview_health._Marks): a GPU's or rank's finding marks its GPU,
// any other its node, a link both ends. Without this a resolved finding stayed painted on the map until the next
// refresh (up to REFRESH_MS), beside a list that no longer held it. Recomputed from the list while the page knows
// every open finding (the API lists at most 100); past that a resolve cannot be told apart from a finding the page
// never saw, so live frames only raise marks and the refresh lowers them.
let allKnown = true;

function markOne(f) {
  const n = byHost.get(f.node);
  if (n) {
    n.severity = worst(n.severity, f.severity);
    if (f.gpu_index !== null && f.gpu_index !== undefined && (f.subject_type === "gpu" || f.subject_type === "rank")) {
      const g = n.gpuObjs.find((x) => x.index === f.gpu_index);
      if (g) { g.sev = worst(g.sev, f.severity); g.url = g.url || `${n.url}gpus/${g.index}/`; }
    } else {
      n.node_severity = worst(n.node_severity, f.severity);
    }
  }
  const peer = f.peer_node ? byHost.get(f.peer_node) : null;
  if (peer) { peer.severity = worst(peer.severity, f.severity); peer.node_severity = worst(peer.node_severity, f.severity); }
}

function remark(rows) {
  if (!allKnown) { for (const f of rows) if (f.state === "open") markOne(f); return; }
  for (const n of nodes) {
    n.severity = null;
    n.node_severity = null;
    for (const g of n.gpuObjs) g.sev = null;
  }
  for (const f of findings.values()) markOne(f);
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
// Drawn on one canvas in one pass (a rectangle per GPU): at 2,048 x 8 cells a plotly heatmap cost hundreds of ms per
// redraw and made the first paint wait for plotly itself; this costs a few ms and needs nothing but the page.
const UTIL_COLORS = (() => {  // the 0..100 ramp from UTIL_LO to UTIL_HI, one colour per percent
  const rgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const [lo, hi] = [rgb(UTIL_LO), rgb(UTIL_HI)];
  return Array.from({length: 101}, (_, v) => `rgb(${lo.map((a, k) => Math.round(a + (hi[k] - a) * v / 100)).join(",")})`);
})();
const CODE_COLORS = {101: SEV_COLORS.info, 102: SEV_COLORS.warning, 103: SEV_COLORS.error, 104: SEV_COLORS.critical,
  105: SEV_COLORS.stale, 106: SEV_COLORS.down};
const colorOf = (code) => (code <= 100 ? UTIL_COLORS[Math.round(code)] : CODE_COLORS[code]);

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
  const cells = [], labels = [];  // labels: [text, bold]
  for (const grp of groups) {
    if (key && !packed) { cells.push(Array(width).fill(null)); labels.push([grp.name, true]); }
    for (let i = 0; i < grp.nodes.length; i += per) {
      const row = Array(width).fill(null);
      grp.nodes.slice(i, i + per).forEach((n, k) => n.gpuObjs.forEach((g, j) => { row[k * (G + 1) + j] = [n, g]; }));
      cells.push(row);
      labels.push([packed ? (i === 0 ? grp.name : "") : grp.nodes[i].host, false]);
    }
    if (key && packed) { cells.push(Array(width).fill(null)); labels.push(["", false]); }
  }
  const box = {left: packed ? 90 : 110, top: 6, bottom: packed ? 6 : 24, right: 10, row: packed ? 7 : 22};
  grid = {cells, labels, packed, G, width, groups: groups.length, box, cellW: 1};
}

function mapCanvas(el) {
  let canvas = el.querySelector("canvas");
  if (canvas) return canvas;
  el.textContent = "";
  canvas = document.createElement("canvas");
  canvas.style.display = "block";
  el.appendChild(canvas);
  canvas.addEventListener("mousemove", (ev) => showTip(cellAt(canvas, ev), ev));
  canvas.addEventListener("mouseleave", () => { $("map-tip").hidden = true; });
  canvas.addEventListener("click", (ev) => { const c = cellAt(canvas, ev); if (c) location.href = targetOf(c[0], c[1], ev.shiftKey); });
  // Where a GPU's cell is on the screen (its centre, client coordinates), or null: what a click there opens.
  el.cellCenter = (host, index) => {
    const {box, cellW} = grid;
    const rect = canvas.getBoundingClientRect();
    for (let r = 0; r < grid.cells.length; r++) {
      const c = grid.cells[r].findIndex((x) => x && x[0].host === host && x[1].index === index);
      if (c >= 0) return {x: rect.left + box.left + (c + 0.5) * cellW, y: rect.top + box.top + (r + 0.5) * box.row};
    }
    return null;
  };
  window.addEventListener("resize", () => markMap());
  return canvas;
}

function cellAt(canvas, ev) {
  const {box, cellW} = grid;
  const rect = canvas.getBoundingClientRect();
  const r = Math.floor((ev.clientY - rect.top - box.top) / box.row);
  const c = Math.floor((ev.clientX - rect.left - box.left) / cellW);
  return (grid.cells[r] || [])[c] || null;
}

function drawMap() {
  const el = $("healthmap");
  if (!nodes.length) { el.innerHTML = '<p class="empty">No node has reported yet.</p>'; afterFirstPaint(); return; }
  buildGrid();
  const now = performance.now();
  const states = new Map(nodes.map((n) => [n, nodeState(n, now)]));
  const canvas = mapCanvas(el);
  const {box} = grid;
  const cssW = Math.max(300, el.clientWidth || 800);
  const cssH = Math.max(120, box.row * grid.cells.length + box.top + box.bottom);
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
    canvas.style.width = `${cssW}px`;
    canvas.style.height = `${cssH}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  const cellW = grid.cellW = (cssW - box.left - box.right) / grid.width;
  const gapX = grid.packed ? 0 : 2, gapY = 1;
  let painted = 0;
  grid.cells.forEach((row, r) => {
    const y = box.top + r * box.row;
    row.forEach((cell, c) => {
      if (!cell) return;
      ctx.fillStyle = colorOf(cellCode(cell[0], cell[1], states.get(cell[0])));
      ctx.fillRect(box.left + c * cellW + gapX / 2, y + gapY / 2, Math.max(1, cellW - gapX), box.row - gapY);
      painted += 1;
    });
  });
  ctx.fillStyle = "#444";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  grid.labels.forEach(([text, bold], r) => {
    if (!text) return;
    ctx.font = `${bold ? "bold " : ""}${grid.packed ? 10 : 12}px sans-serif`;
    ctx.fillText(text, box.left - 6, box.top + (grid.packed ? r * box.row + 3 : (r + 0.5) * box.row), box.left - 8);
  });
  if (!grid.packed) {
    ctx.textAlign = "center";
    ctx.font = "12px sans-serif";
    for (let i = 0; i < grid.G; i++) ctx.fillText(`GPU ${i}`, box.left + (i + 0.5) * cellW, cssH - box.bottom / 2);
  }
  el.dataset.cells = String(painted);
  el.dataset.painted = String(performance.now());
  drawSummary(states);
  drawTrouble(states);
  afterFirstPaint();
}

// The page of what the colour is about: the GPU when its own finding is the worst thing on it, else the node;
// shift-click opens the GPU when it has a page link (the API gives one to every GPU a finding names).
function targetOf(n, g, shift) {
  const own = g.sev && sevRank[g.sev] >= (n.node_severity ? sevRank[n.node_severity] : -1);
  return (shift || own) && g.url ? g.url : n.url;
}

function showTip(c, e) {
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
  tip.style.left = `${(e.pageX || 0) + 14}px`;
  tip.style.top = `${(e.pageY || 0) + 14}px`;
  tip.hidden = false;
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
    `<td>${link(f.subject_url, f.subject)}</td><td>${link(f.url, f.title)} ${badges(f)}</td>` +
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
  if (!window.Plotly) return;  // drawn once plotly has loaded, after the map's first paint
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
// 16,384 rows a frame at 2,048 nodes: plain field writes, no object built per row.
function onGpus(rows) {
  const now = performance.now();
  for (const row of rows) {
    const n = byHost.get(row[0]);
    if (!n) continue;  // a node the last overview did not know: the next refresh adds it
    n.arrived = now;
    const g = n.gpuObjs.find((x) => x.index === row[1]);
    if (!g) continue;
    g.util = row[3];
    g.mem = row[4] === null ? null : row[4] / 2 ** 30;
    g.temp = row[6];
    g.arrived = now;
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
  if (frame.findings) { onFindings(frame.findings, frame.type === "snapshot"); remark(frame.findings); markLists(); markMap(); }
  if (frame.events) { addEvents(frame.events); markLists(); }
});
setInterval(async () => {
  try { adopt(await getJSON(api.overview_api)); markMap(); markLists(); } catch (err) { /* the next refresh retries */ }
}, REFRESH_MS);
setInterval(markMap, 3000);  // a node that goes quiet turns stale without any frame to say so
