// The run page: the whole run from the steps API (downsampled on the server, refetched finer on zoom), the live tail
// from the websocket (aggregated per step here, cheaply: a few additions per row), rank x step heatmaps, settings,
// NCCL, and the explain view of a clicked step with every layer the explain API returns.
import {$, age, esc, fmt, getJSON, link, pageData, when} from "./lib/fmt.js";
import {connectLive, drawLoop} from "./lib/live.js";
import {CONFIG, layout, loadPlotly, react as plot} from "./lib/chart.js";
import {explainTables, timelineTraces} from "./run_explain.js";
import {badges} from "./lib/attention.js";
import {drawNccl} from "./run_nccl.js";

const P = pageData();
const C = {data: "#e4572e", compute: "#29335c", comm: "#f3a712", other: "#a8c686", max: "#9d0208"};
const MAX_LIVE_STEPS = 3000;
const PER_RANK_STEPS = 20;

const agg = new Map();       // step -> {n, ts, st, stmax, dw, cp, cm, tok, seen: Set | null}
const perRank = new Map();   // step -> Map(rank -> STEP_ROW), only for runs the per-rank bars are drawn for
const STALE_S = 15;           // the server's default heartbeat timeout
const gpus = new Map();      // "host|gpu" -> GPU_ROW, this run's nodes only
const events = [];
let findings = [];
let run = {};
let history = null;          // the steps API's answer for the current window
let zoom = null;             // [from_step, to_step] the user zoomed to, or null: the whole run
let heatMetric = "compute_s";
// Plotly attaches .on() to an element at its first plot: handlers wait for it.
const handlers = {};   // id -> [[event, fn]]
function attach(id) {
  const el = document.getElementById(id);
  if (el && el.on && handlers[id]) { for (const [ev, fn] of handlers[id]) el.on(ev, fn); delete handlers[id]; }
}
function react(id, traces, lay, config) {
  const el = plot(id, traces, lay, config);
  attach(id);
  return el;
}
// A figure drawn before plotly had run is drawn when it has: its handlers are attached then.
window.addEventListener("cdx:plotly", () => { for (const id of Object.keys(handlers)) attach(id); });
const on = (id, ev, fn) => { (handlers[id] = handlers[id] || []).push([ev, fn]); };
const smallRun = () => (run.ranks || P.n_ranks) <= P.per_rank_max;
const mine = (host) => Object.prototype.hasOwnProperty.call(P.hosts, host);

// -- live frames -----------------------------------------------------------------------------------------------
function addAgg(step, a) {
  agg.set(step, a);
  if (agg.size > MAX_LIVE_STEPS) agg.delete(Math.min(...[...agg.keys()].slice(0, 64)));
}

// A per-rank row folded into its step's aggregate. A step the snapshot aggregated has no rank set: its rows are
// counted until the step has every rank (a row the snapshot already held may come again once, at connect).
function addRow(r) {
  const [step, rank, ts, st, dw, cp, cm, tok] = r;
  let a = agg.get(step);
  if (!a) { a = {n: 0, ts, st: 0, stmax: 0, dw: 0, cp: 0, cm: 0, tok: 0, seen: new Set()}; addAgg(step, a); }
  if (a.seen ? a.seen.has(rank) : a.n >= (run.ranks || Infinity)) return;
  if (a.seen) a.seen.add(rank);
  const n = a.n + 1;
  a.st += (st - a.st) / n; a.dw += ((dw || 0) - a.dw) / n; a.cp += ((cp || 0) - a.cp) / n; a.cm += ((cm || 0) - a.cm) / n;
  a.stmax = Math.max(a.stmax, st); a.tok += tok || 0; a.ts = Math.max(a.ts, ts); a.n = n;
  if (smallRun()) {
    let m = perRank.get(step);
    if (!m) { m = new Map(); perRank.set(step, m); }
    m.set(rank, r);
    if (perRank.size > PER_RANK_STEPS) perRank.delete(Math.min(...perRank.keys()));
  }
}

function onFrame(f) {
  if (f.type === "snapshot" && f.run) {
    run = f.run;
    for (const [step, ts, n, st, stmax, dw, cp, cm, tok] of run.recent.rows) {
      addAgg(step, {n, ts, st, stmax, dw: dw || 0, cp: cp || 0, cm: cm || 0, tok: tok || 0, seen: null});
    }
  }
  for (const r of f.steps || []) addRow(r);
  for (const g of f.gpus || []) if (mine(g[0])) gpus.set(g[0] + "|" + g[1], g);
  for (const e of f.events || []) if (!e.host || mine(e.host)) events.unshift(e);
  events.length = Math.min(events.length, 50);
  if (f.findings) {
    const ours = f.findings.filter((x) => x.run === P.run || (x.node && mine(x.node)));
    const byId = new Map((f.type === "snapshot" ? [] : findings).map((x) => [x.id, x]));
    for (const x of ours) byId.set(x.id, x);
    findings = [...byId.values()].filter((x) => x.state !== "resolved");
  }
  markDirty();
}

// -- the steps chart: history buckets + live tail ----------------------------------------------------------------
function liveTail() {
  const last = history && history.to_step !== undefined ? history.to_step : -1;
  if (zoom && history && history.to_step < (history.last_step ?? -1)) return [];  // zoomed into the past
  return [...agg.keys()].filter((s) => s > last).sort((a, b) => a - b).map((s) => [s, agg.get(s)]);
}

function stepSeries() {
  const h = history && history.step ? history : {step: []};
  const o = {x: [], slow: [], dw: [], cp: [], cm: [], other: [], max: [], tps: [], tpsMin: [], tpsMax: []};
  h.step.forEach((s, i) => {
    const st = h.step_time_s.mean[i], dw = h.data_wait_s.mean[i] || 0, cp = h.compute_s.mean[i] || 0, cm = h.comm_s.mean[i] || 0;
    o.x.push(s); o.slow.push(h.slowest_step[i]); o.dw.push(dw); o.cp.push(cp); o.cm.push(cm);
    o.other.push(st === null ? null : Math.max(0, st - dw - cp - cm)); o.max.push(h.step_time_s.max[i]);
    o.tps.push(h.tokens_per_s.mean[i]); o.tpsMin.push(h.tokens_per_s.min[i]); o.tpsMax.push(h.tokens_per_s.max[i]);
  });
  for (const [s, a] of liveTail()) {
    o.x.push(s); o.slow.push(s); o.dw.push(a.dw); o.cp.push(a.cp); o.cm.push(a.cm);
    o.other.push(Math.max(0, a.st - a.dw - a.cp - a.cm)); o.max.push(a.stmax);
    const tps = a.st > 0 ? a.tok / a.st : null;
    o.tps.push(tps); o.tpsMin.push(tps); o.tpsMax.push(tps);
  }
  return o;
}

const area = (name, x, y, color, custom) => ({type: "scatter", mode: "lines", stackgroup: "split", name, x, y,
  customdata: custom, line: {width: 0.5, color}, fillcolor: color + "cc", hovertemplate: "%{y:.3f} s"});

function drawSteps() {
  const s = stepSeries();
  react("steps", [area("data wait", s.x, s.dw, C.data, s.slow), area("compute", s.x, s.cp, C.compute, s.slow),
    area("communication", s.x, s.cm, C.comm, s.slow), area("other", s.x, s.other, C.other, s.slow),
    {type: "scatter", mode: "lines", name: "slowest rank", x: s.x, y: s.max, customdata: s.slow,
      line: {color: C.max, width: 1, dash: "dot"}, hovertemplate: "%{y:.3f} s"}],
  layout({uirevision: "steps", xaxis: {title: "step"}, yaxis: {title: "seconds", rangemode: "tozero"}}),
  {...CONFIG, displayModeBar: false});
  const res = history && history.bucket_steps > 1 ? `(${history.bucket_steps} steps per point)` : "";
  $("steps-res").textContent = res;
  react("tokens", [
    {type: "scatter", mode: "lines", x: s.x, y: s.tpsMax, line: {width: 0}, hoverinfo: "skip", showlegend: false},
    {type: "scatter", mode: "lines", x: s.x, y: s.tpsMin, line: {width: 0}, fill: "tonexty", fillcolor: "#29335c33",
      hoverinfo: "skip", showlegend: false},
    {type: "scatter", mode: "lines", name: "tokens/s", x: s.x, y: s.tps, line: {color: C.compute, width: 1.5}}],
  layout({uirevision: "steps", showlegend: false, xaxis: {title: "step"}, yaxis: {title: "tokens/s", rangemode: "tozero"}}));
  drawKpis(s);
}

function drawHistoryCharts() {
  const h = history;
  if (!h || !h.mfu) return;  // a run without steps yet
  const pct = (a) => a.map((v) => (v === null ? null : 100 * v));
  const line = (name, y, color) => ({type: "scatter", mode: "lines", name, x: h.step, y, connectgaps: false, line: {color, width: 1.5}});
  // MFU per step as the pass stored it; before its first pass, the figure computed over each bucket's last steps
  const mfu = (h.mfu_step || []).some((v) => v !== null) ? h.mfu_step : h.mfu;
  react("efficiency", [line("MFU", pct(mfu), "#2a9d8f"), {...line("goodput (16 steps)", pct(h.goodput), "#8d6a9f"), line: {color: "#8d6a9f", width: 1, dash: "dot"}}],
    layout({uirevision: "eff", xaxis: {title: "step"}, yaxis: {title: "%", rangemode: "tozero"}}));
  const spikes = h.loss_spikes || [];
  const sevColor = {info: "#6c757d", warning: "#f3a712", error: "#d00000", critical: "#9d0208"};
  react("loss", [line("loss", h.loss, "#bc4749"), {type: "scatter", mode: "markers", name: "spike", x: spikes.map((s) => s.step),
    y: spikes.map((s) => s.loss), text: spikes.map((s) => s.title), customdata: spikes.map((s) => s.url), hovertemplate: "%{text}<extra></extra>",
    marker: {symbol: "x", size: 11, color: spikes.map((s) => sevColor[s.severity] || "#d00000")}}],
  layout({uirevision: "loss", showlegend: false, hovermode: "closest", xaxis: {title: "step"}, yaxis: {title: "loss"}}));
  document.body.dataset.lossSpikes = String(spikes.length);
  react("gradnorm", [line("grad norm", h.grad_norm, "#669bbc")],
    layout({uirevision: "gn", showlegend: false, xaxis: {title: "step"}, yaxis: {title: "grad norm"}}));
}

function drawKpis(s) {
  const steps = [...agg.keys()];
  if (steps.length) {
    const newest = Math.max(...steps);
    // the newest step is often still arriving: show the newest one most ranks have reported
    const full = steps.filter((k) => agg.get(k).n >= 0.5 * (run.ranks || 1));
    const a = agg.get(full.length ? Math.max(...full) : newest);
    $("kpi-step").textContent = newest;
    $("kpi-step-time").textContent = fmt(a.st, 3) + " s";
    $("kpi-tokens").textContent = a.st > 0 ? Math.round(a.tok / a.st).toLocaleString() : "–";
    $("kpi-data").textContent = a.st > 0 ? fmt(100 * a.dw / a.st, 0) + "%" : "–";
    $("kpi-ranks").textContent = `${a.n}${run.ranks ? " / " + run.ranks : ""}`;
    const stalled = Date.now() / 1000 - a.ts;
    $("run-state").textContent = stalled > 60 ? `no step for ${age(a.ts)}` : "stepping";
    $("run-state").className = "pill " + (stalled > 60 ? "warn" : "ok");
  } else if (s.x.length) {
    $("kpi-step").textContent = history.last_step;
  }
  const eff = history && history.efficiency;
  if (eff) {
    $("kpi-mfu").textContent = eff.mfu === null ? "–" : fmt(100 * eff.mfu, 1) + "%";
    $("kpi-goodput").textContent = eff.goodput === null ? "–" : fmt(100 * eff.goodput, 0) + "%";
  }
  drawGoodput(history && history.run_efficiency);
}

// Goodput over the whole run, with where the rest of the wall time went (the pass's accounting).
function drawGoodput(g) {
  if (!g || g.goodput === null) return;
  $("kpi-goodput").textContent = fmt(100 * g.goodput, 1) + "%";
  const lost = Object.entries(g.lost_s || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${dur(v)}`);
  $("goodput-detail").textContent = `Goodput ${fmt(100 * g.goodput, 1)}%: ${dur(g.productive_s)} productive of ${dur(g.wall_s)} wall time` +
    (lost.length ? ` · lost: ${lost.join(", ")}` : " · nothing lost") + (g.restarts ? ` · ${g.restarts} restart(s)` : "") +
    (g.mfu !== null ? ` · MFU over the run ${fmt(100 * g.mfu, 1)}%` : "") + ` · through step ${g.through_step}`;
}

async function loadHistory() {
  const q = new URLSearchParams({points: "600"});
  if (zoom) { q.set("from_step", Math.max(0, Math.floor(zoom[0]))); q.set("to_step", Math.max(0, Math.ceil(zoom[1]))); }
  try {
    history = await getJSON(`${P.api.steps}?${q}`);
    document.body.dataset.historyBucket = String(history.bucket_steps);
  } catch (e) { console.warn(e); return; }
  // The step split first, in a task of its own: MFU, loss and grad norm (three more plots) follow in the next one.
  drawSteps();
  setTimeout(drawHistoryCharts, 0);
  loadHeatmap();
}

// -- rank x step heatmap -----------------------------------------------------------------------------------------
let heat = null;
async function loadHeatmap() {
  const q = new URLSearchParams({metric: heatMetric, points: "600"});
  if (zoom) { q.set("from_step", Math.max(0, Math.floor(zoom[0]))); q.set("to_step", Math.max(0, Math.ceil(zoom[1]))); }
  try { heat = await getJSON(`${P.api.heatmap}?${q}`); } catch (e) { console.warn(e); return; }
  const labels = heat.rows.map((r) => (r.rank !== undefined ? `${r.host || "?"} · rank ${r.rank}` : r.label));
  heat.rowOf = new Map(labels.map((l, i) => [l, i]));
  const shapes = heat.nodes.length <= 512 ? heat.nodes.slice(1).map((n) => ({type: "line", xref: "paper", x0: 0, x1: 1,
    y0: n.first_row - 0.5, y1: n.first_row - 0.5, line: {color: "#ffffff", width: 1}})) : [];
  const every = Math.max(1, Math.ceil(heat.nodes.length / 40));
  const ticks = heat.nodes.filter((_, i) => i % every === 0);
  react("rank-heatmap", [{type: "heatmap", z: heat.z, x: heat.steps, y: labels, zmin: heat.scale.p5 ?? undefined,
    zmax: heat.scale.p99 ?? undefined, colorscale: "Viridis", colorbar: {title: {text: "s"}},
    hovertemplate: "%{y}<br>step %{x}: %{z:.3f} s<extra></extra>"}],
  layout({hovermode: "closest", shapes, height: Math.min(900, Math.max(300, 3 * heat.rows.length + 80)), margin: {l: 110, r: 10, t: 10, b: 35},
    xaxis: {title: "step"}, yaxis: {type: "category", autorange: "reversed", tickvals: ticks.map((n) => labels[n.first_row]), ticktext: ticks.map((n) => n.host || "?")}}));
  document.body.dataset.heatmapRows = String(heat.rows.length);
}

// -- per-rank bars (small runs) ----------------------------------------------------------------------------------
function drawRanks() {
  if (!smallRun()) { $("ranks-card").hidden = true; return; }
  const per = new Map();
  for (const m of perRank.values()) for (const r of m.values()) {
    const acc = per.get(r[1]) || [0, 0, 0, 0];
    acc[0] += r[4] || 0; acc[1] += r[5] || 0; acc[2] += r[6] || 0; acc[3] += 1;
    per.set(r[1], acc);
  }
  const ranks = [...per.keys()].sort((a, b) => a - b);
  const x = ranks.map((r) => `rank ${r}`);
  const y = (i) => ranks.map((r) => per.get(r)[i] / per.get(r)[3]);
  react("ranks", [
    {type: "bar", name: "data wait", x, y: y(0), customdata: ranks, marker: {color: C.data}},
    {type: "bar", name: "compute", x, y: y(1), customdata: ranks, marker: {color: C.compute}},
    {type: "bar", name: "communication", x, y: y(2), customdata: ranks, marker: {color: C.comm}},
  ], layout({barmode: "stack", hovermode: "closest", yaxis: {title: "seconds (mean)"}}));
}

// -- GPU heatmap, lists ------------------------------------------------------------------------------------------
function drawGpus() {
  const rows = [...gpus.values()];
  const hosts = [...new Set(rows.map((r) => r[0]))].sort();
  const width = Math.max(1, ...rows.map((r) => r[1] + 1));
  const z = hosts.map(() => Array(width).fill(null));
  const hi = new Map(hosts.map((h, i) => [h, i]));
  // A GPU whose samples stopped (a dead node) must not keep its last utilisation: compared with the newest sample of
  // the run's nodes (one clock for all, so a simulated or skewed clock does not grey out the healthy ones).
  const newest = Math.max(...rows.map((r) => r[2]));
  const stale = new Set();
  for (const r of rows) {
    if (newest - r[2] > STALE_S) { stale.add(r[0]); continue; }
    z[hi.get(r[0])][r[1]] = r[3];
  }
  const labels = hosts.map((h) => (stale.has(h) ? h + " (stale)" : h));
  react("heatmap", [{type: "heatmap", z, x: [...Array(width).keys()].map((i) => "GPU " + i), y: labels, zmin: 0, zmax: 100,
    colorscale: "Viridis", colorbar: {title: {text: "util %"}}, hovertemplate: "%{y} %{x}: %{z:.0f}%<extra></extra>"}],
  layout({hovermode: "closest", margin: {l: 110, r: 10, t: 10, b: 30}, height: Math.min(900, Math.max(220, 18 * hosts.length + 60))}));
}

function drawLists() {
  $("events").innerHTML = events.map((e) => `<li class="sev-${esc(e.severity)}"><span class="muted">${esc(age(e.ts))} ago</span>
    ${link(P.hosts[e.host], e.host)} ${esc(e.kind)}${e.code !== null && e.code !== undefined ? " " + esc(e.code) : ""}: ${esc(e.message)}</li>`).join("")
    || '<li class="muted">No warnings.</li>';
  const sorted = [...findings].sort((a, b) => b.updated_at - a.updated_at);
  $("findings").innerHTML = sorted.map((f) => `<li class="sev-${esc(f.severity)}"><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span>
    ${link(f.url, f.title)} ${badges(f)}<br><span class="muted">${link(f.subject_url, f.subject)} · open ${esc(age(f.opened_at))}</span><br>${esc(f.action || "")}</li>`).join("")
    || '<li class="muted">None open.</li>';
}

const markDirty = drawLoop(() => {
  drawLists();
  if (!window.Plotly) return false; // loadPlotly() below marks the page dirty once it has run: the charts then draw at once
  drawSteps(); drawRanks(); drawGpus();
  return true;
}, 500);

// -- settings and NCCL -------------------------------------------------------------------------------------------
const kv = (obj) => Object.entries(obj || {}).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(typeof v === "object" && v !== null ? JSON.stringify(v) : v ?? "–")}</td></tr>`).join("");

function majorityTable(sec, title) {
  const rows = Object.entries(sec.values).map(([k, v]) => `<tr class="${v.distinct > 1 || v.drift ? "drift" : ""}"><th>${esc(k)}</th>
    <td>${esc(v.value ?? "(unset)")}</td><td class="num">${v.ranks}/${sec.ranks}</td></tr>`).join("");
  return `<div><h3>${esc(title)}</h3><table class="data"><tr><th></th><th>majority</th><th class="num">ranks</th></tr>${rows ||
    '<tr><td class="muted" colspan="3">not reported</td></tr>'}</table></div>`;
}

function deviationTable(rows, total, what) {
  if (!rows.length) return `<p class="muted">Every rank agrees on its ${esc(what)}.</p>`;
  return `<table class="data drift-table"><tr><th>rank</th><th>node</th><th>GPU</th><th>setting</th><th>its value</th><th>majority</th></tr>${rows.map((d) =>
    `<tr class="drift"><td>${link(d.url, "rank " + d.rank)}</td><td>${link(d.node_url, d.host || "?")}</td><td>${link(d.gpu_url, d.gpu ?? "–")}</td>
    <td>${esc(d.key)}</td><td>${esc(d.value ?? "(unset)")}</td><td>${esc(d.majority ?? "(unset)")}</td></tr>`).join("")}</table>` +
    (total > rows.length ? `<p class="muted">and ${total - rows.length} more</p>` : "");
}

const dur = (s) => (s === null || s === undefined ? "–" : s >= 3600 ? fmt(s / 3600, 1) + " h" : s >= 60 ? fmt(s / 60, 1) + " min" : fmt(s, 1) + " s");

function drawLayout(sec) {
  const names = {strategy: "strategy", mesh: "device mesh", zero_stage: "ZeRO stage", offload: "offload", activation_checkpointing: "activation checkpointing",
    grad_accum: "gradient accumulation", micro_batch: "micro-batch", sharding: "FSDP sharding", pp_schedule: "pipeline schedule", pp_microbatches: "pipeline micro-batches"};
  const show = (v) => (v === true ? "on" : v === false ? "off" : v);
  const rows = Object.entries(sec.values).map(([k, v]) => `<tr class="${v.distinct > 1 ? "drift" : ""}"><th>${esc(names[k] || k)}</th>
    <td>${esc(v.value === null || v.value === undefined ? "(unset)" : show(v.value))}</td><td class="num">${v.ranks}/${sec.ranks}</td></tr>`).join("");
  $("layout").innerHTML = rows ? `<table class="data layout"><tr><th></th><th>majority</th><th class="num">ranks</th></tr>${rows}</table>
    ${deviationTable(sec.deviations, sec.deviating, "layout")}` : '<p class="muted">Not reported (hooks older than the layout, or a single process).</p>';
}

async function loadSettings() {
  const s = await getJSON(P.api.settings);
  if (s.layout) drawLayout(s.layout);
  const w = s.run_wide;
  const head = {"world size": s.world_size, "ranks reporting": s.ranks_reporting, nodes: s.nodes, dtype: w.dtype,
    parameters: w.params ? (w.params / 1e9).toFixed(2) + " B" : null, "FLOPs per token": w.flops_per_token ? w.flops_per_token.toExponential(3) : null,
    "peak FLOPS per GPU": w.peak_flops ? w.peak_flops.toExponential(3) : null, GPU: w.gpu_name,
    "parallel layout": Object.entries(s.parallel).map(([k, v]) => `${k}=${v}`).join(" × ") || null,
    "last checkpoint": w.last_checkpoint_step !== null && w.last_checkpoint_step !== undefined ? `step ${w.last_checkpoint_step} (${age(w.last_checkpoint_ts)} ago)` : null};
  $("settings").innerHTML = `<div class="grid three"><div><h3>Run</h3><table class="data">${kv(head)}</table></div>
    ${majorityTable(s.versions, "Versions")}${majorityTable(s.dataloader, "DataLoader")}</div>
    <h3>NCCL / torch.distributed environment <span class="muted">${s.env.drifting_ranks} rank(s) differ from the majority</span></h3>
    <div class="grid"><div>${majorityTable(s.env, "Majority")}</div><div><h3>Drift</h3>${deviationTable(s.env.drift, s.env.drift.length, "NCCL settings")}
    <h3>DataLoader differences</h3>${deviationTable(s.dataloader.deviations, s.dataloader.deviating, "DataLoader")}
    <h3>Version differences</h3>${deviationTable(s.versions.deviations, s.versions.deviating, "versions")}</div></div>`;
}

async function loadNccl() {
  drawNccl(await getJSON(P.api.nccl), (url) => go(url));
}

// -- explain -----------------------------------------------------------------------------------------------------
async function explain(step) {
  $("explain").hidden = false;
  $("explain-step").textContent = step;
  $("explain-cause").textContent = "Loading…";
  let d;
  try { d = await getJSON(`${P.api.explain_prefix}${step}/explain`); } catch (e) {
    $("explain-cause").textContent = `No data for step ${step}.`; return;
  }
  const c = d.cause;
  $("explain-cause").innerHTML = `Most likely: ${esc(c.summary)} <span class="muted">(${esc(c.kind)}, confidence ${Math.round(100 * c.confidence)}%;
    step ${fmt(d.step_time_s, 3)} s, usually ${fmt(d.baseline_step_time_s, 3)} s)</span>`;
  const tl = timelineTraces(d);
  react("explain-timeline", tl.traces, layout({hovermode: "closest", shapes: tl.shapes, showlegend: false,
    height: 80 + 34 * tl.lanes.length, xaxis: {type: "date"}, yaxis: {type: "category", categoryarray: tl.lanes, automargin: true}}));
  const ranks = [...d.ranks].sort((a, b) => (b.comm_arrive_s ?? (b.data_wait_s || 0) + (b.compute_s || 0)) - (a.comm_arrive_s ?? (a.data_wait_s || 0) + (a.compute_s || 0))).slice(0, 48);
  const x = ranks.map((r) => `rank ${r.rank}`);
  const bar = (name, key, color) => ({type: "bar", name, x, y: ranks.map((r) => r[key]), customdata: ranks.map((r) => r.rank), marker: {color}});
  react("explain-ranks", [bar("data wait", "data_wait_s", C.data), bar("compute", "compute_s", C.compute), bar("communication", "comm_s", C.comm)],
    layout({barmode: "stack", hovermode: "closest", yaxis: {title: "seconds"}}));
  const t = explainTables(d, P);
  for (const [id, html] of Object.entries(t)) $(id).innerHTML = html;
  document.body.dataset.explained = String(step);
}

// -- wiring ------------------------------------------------------------------------------------------------------
const rankUrl = (rank) => (P.ranks[rank] || {}).url;
const go = (url) => { if (url) location.href = url; };
on("steps", "plotly_click", (ev) => { const p = ev.points[0]; explain(p.customdata ?? p.x); });
on("steps", "plotly_relayout", (ev) => {
  if (ev["xaxis.autorange"]) { zoom = null; loadHistory(); return; }
  const a = ev["xaxis.range[0]"], b = ev["xaxis.range[1]"];
  if (a !== undefined && b !== undefined) { zoom = [a, b]; loadHistory(); }
});
on("ranks", "plotly_click", (ev) => go(rankUrl(ev.points[0].customdata)));
on("explain-ranks", "plotly_click", (ev) => go(rankUrl(ev.points[0].customdata)));
on("rank-heatmap", "plotly_click", (ev) => { const i = heat && heat.rowOf.get(ev.points[0].y); go(i !== undefined && heat.rows[i].url); });
on("heatmap", "plotly_click", (ev) => go(P.hosts[String(ev.points[0].y).replace(" (stale)", "")]));

$("heatmap-metric").addEventListener("click", (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  heatMetric = b.dataset.metric;
  for (const x of $("heatmap-metric").querySelectorAll("button")) x.classList.toggle("on", x === b);
  loadHeatmap();
});

connectLive(P.ws, onFrame);
// The step history first and alone: the settings and NCCL panels (below the first screen) are asked for once it has
// come, so the server answers the first chart's request without sharing its CPU with theirs (three at once took
// 1.3-1.8 s each at 2,048 nodes).
loadHistory().finally(() => {
  loadSettings().catch((e) => { $("settings").textContent = String(e); });
  loadNccl().catch((e) => { $("nccl").textContent = String(e); });
});
loadPlotly().then(markDirty); // after the request above is on the wire: the server works while plotly evaluates
// The history (loss, MFU, the heatmap) is refetched now and then while the whole run is shown; the live tail covers
// the steps in between.
setInterval(() => { if (!zoom && !document.hidden) loadHistory(); }, 60_000);
setInterval(() => { if (!document.hidden) loadNccl().catch(() => {}); }, 60_000);
