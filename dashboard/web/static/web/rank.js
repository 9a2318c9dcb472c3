// A rank's page: its split over the whole run (downsampled on the server, refetched on zoom) plus its live steps,
// its beat, findings and settings. Links come from the API (node, GPU, findings); nothing builds a path here.
import {$, age, esc, fmt, getJSON, link, pageData} from "./lib/fmt.js";
import {connectLive, drawLoop} from "./lib/live.js";
import {layout, react} from "./lib/chart.js";

const P = pageData();
const C = {data: "#e4572e", compute: "#29335c", comm: "#f3a712", other: "#a8c686"};
const live = new Map();  // step -> STEP_ROW of this rank, after the history's last step
let history = null, runHistory = null, zoom = null, bound = false;

function series() {
  const h = history && history.step ? history : {step: []};
  const o = {x: [], dw: [], cp: [], cm: [], other: []};
  h.step.forEach((s, i) => {
    const st = h.step_time_s.mean[i], dw = h.data_wait_s.mean[i] || 0, cp = h.compute_s.mean[i] || 0, cm = h.comm_s.mean[i] || 0;
    o.x.push(s); o.dw.push(dw); o.cp.push(cp); o.cm.push(cm); o.other.push(st === null ? null : Math.max(0, st - dw - cp - cm));
  });
  if (!zoom) {
    const last = history ? history.to_step ?? -1 : -1;
    for (const s of [...live.keys()].filter((k) => k > last).sort((a, b) => a - b)) {
      const r = live.get(s);
      o.x.push(s); o.dw.push(r[4] || 0); o.cp.push(r[5] || 0); o.cm.push(r[6] || 0);
      o.other.push(Math.max(0, r[3] - (r[4] || 0) - (r[5] || 0) - (r[6] || 0)));
    }
  }
  return o;
}

const area = (name, x, y, color) => ({type: "scatter", mode: "lines", stackgroup: "split", name, x, y,
  line: {width: 0.5, color}, fillcolor: color + "cc", hovertemplate: "%{y:.3f} s"});

function draw() {
  const s = series();
  const traces = [area("data wait", s.x, s.dw, C.data), area("compute", s.x, s.cp, C.compute),
    area("communication", s.x, s.cm, C.comm), area("other", s.x, s.other, C.other)];
  if (runHistory && runHistory.step) {
    traces.push({type: "scatter", mode: "lines", name: "run mean step time", x: runHistory.step, y: runHistory.step_time_s.mean,
      line: {color: "#333", width: 1, dash: "dot"}});
  }
  const el = react("steps", traces, layout({uirevision: "rank", xaxis: {title: "step"}, yaxis: {title: "seconds", rangemode: "tozero"}}));
  $("steps-res").textContent = history && history.bucket_steps > 1 ? `(${history.bucket_steps} steps per point)` : "";
  if (s.x.length) $("last-step").textContent = s.x[s.x.length - 1];
  if (el && el.on && !bound) {
    bound = true;
    el.on("plotly_relayout", (ev) => {
      if (ev["xaxis.autorange"]) { zoom = null; load(); return; }
      if (ev["xaxis.range[0]"] !== undefined) { zoom = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]]; load(); }
    });
  }
}
const markDirty = drawLoop(draw, 500);

async function load() {
  const q = new URLSearchParams({points: "600"});
  if (zoom) { q.set("from_step", Math.max(0, Math.floor(zoom[0]))); q.set("to_step", Math.max(0, Math.ceil(zoom[1]))); }
  [history, runHistory] = await Promise.all([getJSON(`${P.api.steps}?${q}&rank=${P.rank}`), getJSON(`${P.api.steps}?${q}`)]);
  markDirty();
}

const kv = (obj) => `<table class="data">${Object.entries(obj || {}).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(
  v !== null && typeof v === "object" ? Object.entries(v).map(([a, b]) => `${a}=${b}`).join(", ") : v ?? "–")}</td></tr>`).join("")}</table>`;

async function loadRank() {
  const r = await getJSON(P.api.rank);
  const {env, ...meta} = r.meta;
  $("settings").innerHTML = kv(meta);
  $("env").innerHTML = kv(env);
  const b = r.beat;
  $("beat-state").textContent = b ? `${b.state} for ${fmt(b.state_s, 0)} s (step ${b.step ?? "–"}, ${age(b.received)} ago)` : "no beats";
  $("beat").textContent = b ? b.state : "no beats";
  $("beat").className = "pill " + (!b ? "" : ["crashed"].includes(b.state) ? "bad" : b.state === "finished" ? "" : "ok");
  $("findings").innerHTML = r.findings.map((f) => `<li class="sev-${esc(f.severity)}"><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span>
    ${link(f.url, f.title)} <span class="muted">${esc(f.state)} · ${link(f.subject_url, f.subject)} · opened ${esc(age(f.opened_at))} ago</span></li>`).join("")
    || '<li class="muted">No findings.</li>';
}

connectLive(P.ws, (f) => {
  let changed = false;
  for (const r of f.steps || []) if (r[1] === P.rank) { live.set(r[0], r); changed = true; }
  if (live.size > 3000) live.delete(Math.min(...live.keys()));
  if (changed) markDirty();
});
load().catch((e) => console.warn(e));
loadRank().catch((e) => { $("findings").textContent = String(e); });
setInterval(() => { if (!document.hidden) loadRank().catch(() => {}); }, 10_000);
