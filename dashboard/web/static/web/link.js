// One link's page: the pair's probe RTT (median and p99), bandwidth and loss in both directions on one time axis,
// each against the line the diagnosis judges it by (dashed), and the host CPU at both ends (a busy CPU delays
// user-space pings with nothing wrong on the wire). Refreshed every 10 s while the range ends now.
import {$, age, esc, link, pageData} from "./lib/fmt.js";
import {COLORS, bandTraces, hline, layout, react, timeAxis, toDates} from "./lib/chart.js";
import {pollRange} from "./lib/poll.js";

const page = pageData();

// hline() gives {shape, annotation} pairs; a layout wants them as two lists.
function lines(...hl) {
  const ok = hl.filter(Boolean);
  return {shapes: ok.map((h) => h.shape), annotations: ok.map((h) => h.annotation)};
}

function chart(id, traces, yTitle, hl, extra = {}) {
  react(id, traces, layout({xaxis: timeAxis(), yaxis: {title: {text: yTitle}, rangemode: "tozero"}, ...lines(...hl),
    ...extra}));
}

function p99Trace(series, name, color) {
  const s = series.rtt_p99_ms;
  if (!s) return [];
  return [{type: "scatter", mode: "lines", name, x: toDates(series.t), y: s.mean, line: {color, width: 1, dash: "dot"}}];
}

function draw(d) {
  const th = d.thresholds;
  const rtt = [], bw = [], loss = [];
  d.directions.forEach((dir, k) => {
    const name = `${dir.from} → ${dir.to}`;
    const c = COLORS[k === 0 ? 0 : 1];
    if (!dir.series.t) return;
    rtt.push(...bandTraces(dir.series, "rtt_ms", name, c), ...p99Trace(dir.series, `${name} p99`, c));
    bw.push(...bandTraces(dir.series, "bw_gbps", name, c));
    loss.push(...bandTraces(dir.series, "loss", name, c, {scale: 100}));
  });
  // The looser line applies only while an end's CPU is busy: drawn only when one was, in this range.
  const busy = Object.values(d.cpu).some((s) => s.cpu_pct && s.cpu_pct.max.some((v) => v !== null && v >= th.busy_cpu_pct));
  chart("rtt", rtt, "RTT (ms)", [th.rtt_ms !== null && hline(th.rtt_ms, `bad above ${th.rtt_ms} ms`),
    busy && th.rtt_busy_ms !== null && hline(th.rtt_busy_ms, `bad above ${th.rtt_busy_ms} ms while a CPU is busy`, "#6c757d")]);
  chart("bw", bw, "bandwidth (Gb/s)", [th.bw_gbps !== null && hline(th.bw_gbps, `bad below ${th.bw_gbps} Gb/s`)]);
  chart("loss", loss, "lost pings (%)", [hline(th.loss_frac * 100, `bad from ${Math.round(th.loss_frac * 100)}%`)],
    {yaxis: {title: {text: "lost pings (%)"}, range: [0, 100]}});
  const cpu = Object.entries(d.cpu).flatMap(([host, s], k) => (s.t ? bandTraces(s, "cpu_pct", host, COLORS[k + 2]) : []));
  chart("cpu", cpu, "CPU busy (%)", [hline(th.busy_cpu_pct, `busy from ${th.busy_cpu_pct}%`, "#6c757d")],
    {yaxis: {title: {text: "CPU busy (%)"}, range: [0, 105]}});
  const ul = $("findings");
  ul.innerHTML = d.findings.length ? d.findings.map((f) => `<li class="sev-${esc(f.severity)}"><span class="sev ` +
    `${esc(f.severity)}">${esc(f.severity)}</span> ${link(f.url, f.title)} <span class="muted">· ` +
    `${link(f.subject_url, f.subject)} · ${esc(f.kind)} · open ${age(f.opened_at)}</span></li>`).join("")
    : '<li class="muted">No open findings on this link or its nodes.</li>';
  const n = d.directions.reduce((s, dir) => s + (dir.series.t ? dir.series.t.length : 0), 0);
  $("summary").textContent = `${n} points · quiet RTT ${th.baseline_rtt_ms ?? "–"} ms, bandwidth ` +
    `${th.baseline_bw_gbps ?? "–"} Gb/s across the cluster · updated ${new Date().toLocaleTimeString()}`;
}

pollRange(page.api, draw, "1h");
