// The explain view's pieces: what has a time goes on one timeline (the step's window shaded), what is a summary of
// the window (GPU, probes, IB counters) goes in tables. Every node and rank named is a link (urls from the server).
import {esc, fmt, link, when} from "./lib/fmt.js";
import {SEV_COLORS} from "./lib/chart.js";

const LANES = ["step", "NCCL", "Xid", "other events", "findings"];
const date = (ts) => new Date(ts * 1000);

export function timelineTraces(d) {
  const [t0, t1] = d.window;
  const lanes = [];
  const traces = [{type: "scatter", mode: "lines", x: [date(t0), date(t1)], y: ["step", "step"], line: {color: "#29335c", width: 10},
    hovertemplate: `step ${d.step}: ${fmt(d.step_time_s, 3)} s<extra></extra>`}];
  const add = (lane, rows, text) => {
    if (!rows.length) return;
    traces.push({type: "scatter", mode: "markers", x: rows.map((r) => date(r.ts)), y: rows.map(() => lane),
      marker: {size: 11, symbol: "diamond", color: rows.map((r) => SEV_COLORS[r.severity] || "#6c757d")},
      text: rows.map(text), hovertemplate: "%{text}<extra></extra>"});
  };
  const L = d.layers;
  add("NCCL", L.nccl, (e) => `${esc(e.host)}: ${esc(e.message.slice(0, 160))}`);
  add("Xid", L.xid, (e) => `${esc(e.host)} GPU ${e.gpu}: Xid ${e.code} ${esc(e.meaning)}`);
  add("other events", L.other_events, (e) => `${esc(e.host)} ${esc(e.kind)}: ${esc(e.message.slice(0, 160))}`);
  add("findings", (d.findings || []).map((f) => ({...f, ts: f.opened_at})), (f) => `${esc(f.kind)}: ${esc(f.title)}`);
  for (const lane of LANES) if (lane === "step" || traces.some((t) => t.y[0] === lane)) lanes.push(lane);
  const shapes = [{type: "rect", xref: "x", yref: "paper", x0: date(t0), x1: date(t1), y0: 0, y1: 1,
    fillcolor: "#f3a712", opacity: 0.15, line: {width: 0}}];
  return {traces, shapes, lanes: lanes.reverse()};
}

const table = (head, rows, empty) => rows.length
  ? `<table class="data"><tr>${head.map((h) => `<th>${esc(h)}</th>`).join("")}</tr>${rows.map((r) => `<tr>${r.map((c) => `<td>${c}</td>`).join("")}</tr>`).join("")}</table>`
  : `<p class="muted">${esc(empty)}</p>`;

export function explainTables(d, P) {
  const host = (h) => link(P.hosts[h], h || "?");
  const rankUrls = new Map(d.ranks.map((r) => [r.rank, r.url]));
  const rank = (r) => link(rankUrls.get(r) || (P.ranks[r] || {}).url, `rank ${r}`);
  const L = d.layers;
  const g = L.gpus;
  // the ranks whose GPU looked worst in the window: throttled, lowest clock ratio, lowest utilisation
  const worst = [...d.ranks].filter((r) => r.util_gpu_pct !== undefined)
    .sort((a, b) => (b.throttle_reasons || []).length - (a.throttle_reasons || []).length
      || (a.sm_clock_mhz || 0) / (a.sm_clock_max_mhz || 1) - (b.sm_clock_mhz || 0) / (b.sm_clock_max_mhz || 1)
      || (a.util_gpu_pct ?? 100) - (b.util_gpu_pct ?? 100)).slice(0, 12);
  const gpu = `<p>${g.gpus} GPUs · utilisation median ${fmt(g.util_gpu_pct_median, 0)}%, lowest ${fmt(g.util_gpu_pct_min, 0)}%
    · throttled: ${g.throttled.length ? g.throttled.map(esc).join(", ") : "none"}</p>` +
    table(["rank", "node", "GPU", "util %", "SM clock", "temp °C", "throttle"], worst.map((r) => [rank(r.rank), host(r.host),
      esc(r.gpu ?? "–"), fmt(r.util_gpu_pct, 0), `${fmt(r.sm_clock_mhz, 0)}/${fmt(r.sm_clock_max_mhz, 0)}`, fmt(r.temp_c, 0),
      esc((r.throttle_reasons || []).join(", ") || "–")]), "No GPU samples in the window.");
  const pr = L.probes;
  const probes = `<p>${pr.pairs} probes · RTT median ${fmt(pr.rtt_ms_median, 3)} ms</p>` +
    table(["from", "to", "RTT ms", "lost", "Gb/s"], pr.worst.map((p) => [host(p.from), host(p.to), fmt(p.rtt_ms, 3),
      `${p.lost}/${p.sent}`, fmt(p.bw_gbps, 0)]), "No probes in the window.");
  const ib = table(["node", "port", "state", "errors"], L.ib.map((p) => [host(p.host), esc(p.port), esc(p.states.join(", ") || "–"),
    esc(Object.entries(p.errors).map(([k, v]) => `${k} ${v}`).join(", ") || "–")]), "No port errors or down ports.");
  const xid = table(["time", "node", "GPU", "Xid", "meaning", "action"], L.xid.map((x) => [esc(when(x.ts)), host(x.host), esc(x.gpu ?? "–"),
    esc(x.code), esc(x.meaning), esc(x.action)]), "No Xid.");
  const evRow = (e) => [esc(when(e.ts)), host(e.host), e.rank !== null && e.rank !== undefined ? rank(e.rank) : "–",
    `<span class="sev ${esc(e.severity)}">${esc(e.severity)}</span> ${esc(e.kind ? e.kind + ": " : "")}${esc(e.message.slice(0, 300))}`];
  const nccl = table(["time", "node", "rank", "message"], L.nccl.map(evRow), "No NCCL warnings.");
  const other = table(["time", "node", "rank", "message"], L.other_events.map(evRow), "No other warnings.");
  const findings = table(["severity", "finding", "subject", "opened"], (d.findings || []).map((f) => [
    `<span class="sev ${esc(f.severity)}">${esc(f.severity)}</span>`, link(f.url, f.title), link(f.subject_url, f.subject), esc(when(f.opened_at))]),
  "No finding held during the step.");
  return {"explain-gpu": gpu, "explain-probes": probes, "explain-ib": ib, "explain-xid": xid, "explain-nccl": nccl,
    "explain-other": other, "explain-findings": findings};
}
