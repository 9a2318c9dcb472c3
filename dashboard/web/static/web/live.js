// Live run and cluster pages: one websocket, a snapshot then throttled deltas, drawn with plotly.
(function () {
  "use strict";
  const cfg = window.CLUSTERDX || {};
  const MAX_STEPS = 300;
  const steps = new Map();   // step -> Map(rank -> row)
  const gpus = new Map();    // "host|idx" -> row
  const events = [];
  let findings = [];
  let cols = {steps: [], gpus: []};
  let dirty = false;
  let frames = 0;

  const $ = (id) => document.getElementById(id);
  const fmt = (v, d = 2) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

  function addSteps(rows) {
    for (const r of rows) {
      let m = steps.get(r[0]);
      if (!m) { m = new Map(); steps.set(r[0], m); }
      m.set(r[1], r);
    }
    if (steps.size > MAX_STEPS) {
      const keys = [...steps.keys()].sort((a, b) => a - b);
      for (const k of keys.slice(0, keys.length - MAX_STEPS)) steps.delete(k);
    }
  }
  function addGpus(rows) { for (const r of rows) gpus.set(r[0] + "|" + r[1], r); }
  function addEvents(rows) {
    for (const e of rows) events.unshift(e);
    events.length = Math.min(events.length, 50);
  }

  function onFrame(frame) {
    frames += 1;
    if (frame.columns) cols = frame.columns;
    if (frame.steps) addSteps(frame.steps);
    if (frame.gpus) addGpus(frame.gpus);
    if (frame.events) addEvents(frame.events);
    if (frame.findings) findings = frame.type === "snapshot" ? frame.findings : mergeFindings(frame.findings);
    dirty = true;
    document.body.dataset.frames = String(frames);
  }

  function mergeFindings(rows) {
    const byId = new Map(findings.map((f) => [f.id, f]));
    for (const f of rows) byId.set(f.id, f);
    return [...byId.values()].filter((f) => f.state !== "resolved");
  }

  function mean(a) { return a.length ? a.reduce((x, y) => x + y, 0) / a.length : null; }

  function stepSeries() {
    const keys = [...steps.keys()].sort((a, b) => a - b);
    const out = {x: [], data: [], compute: [], comm: [], other: [], total: [], tps: [], ranks: 0};
    for (const k of keys) {
      const rows = [...steps.get(k).values()];
      const st = mean(rows.map((r) => r[3]));
      const dw = mean(rows.map((r) => r[4] || 0));
      const cp = mean(rows.map((r) => r[5] || 0));
      const cm = mean(rows.map((r) => r[6] || 0));
      const tokens = rows.reduce((s, r) => s + (r[7] || 0), 0);
      out.x.push(k); out.data.push(dw); out.compute.push(cp); out.comm.push(cm);
      out.other.push(Math.max(0, st - dw - cp - cm)); out.total.push(st);
      out.tps.push(st > 0 ? tokens / st : null);
      out.ranks = Math.max(out.ranks, rows.length);
    }
    return out;
  }

  const layout = (extra) => Object.assign({margin: {l: 50, r: 10, t: 10, b: 40}, paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: "rgba(0,0,0,0)", font: {size: 12}, legend: {orientation: "h", y: 1.12}}, extra);

  function drawSteps() {
    if (!$("steps")) return;
    const s = stepSeries();
    const bar = (name, y, color) => ({type: "bar", name, x: s.x, y, marker: {color}});
    Plotly.react("steps", [
      bar("data wait", s.data, "#e4572e"), bar("compute", s.compute, "#29335c"),
      bar("communication", s.comm, "#f3a712"), bar("other", s.other, "#a8c686"),
    ], layout({barmode: "stack", xaxis: {title: "step"}, yaxis: {title: "seconds"}}), {displayModeBar: false});
    Plotly.react("tokens", [{type: "scatter", mode: "lines", x: s.x, y: s.tps, line: {color: "#29335c"}}],
      layout({xaxis: {title: "step"}, yaxis: {title: "tokens/s"}}), {displayModeBar: false});
    const n = s.x.length - 1;
    if (n >= 0) {
      $("kpi-step").textContent = s.x[n];
      $("kpi-step-time").textContent = fmt(s.total[n], 3) + " s";
      $("kpi-tokens").textContent = s.tps[n] === null ? "–" : Math.round(s.tps[n]).toLocaleString();
      $("kpi-data").textContent = s.total[n] > 0 ? fmt(100 * s.data[n] / s.total[n], 0) + "%" : "–";
      $("kpi-ranks").textContent = s.ranks;
    }
  }

  function drawRanks() {
    if (!$("ranks")) return;
    const keys = [...steps.keys()].sort((a, b) => a - b).slice(-20);
    const per = new Map();  // rank -> [data, compute, comm] sums, count
    for (const k of keys) {
      for (const r of steps.get(k).values()) {
        const acc = per.get(r[1]) || [0, 0, 0, 0];
        acc[0] += r[4] || 0; acc[1] += r[5] || 0; acc[2] += r[6] || 0; acc[3] += 1;
        per.set(r[1], acc);
      }
    }
    const ranks = [...per.keys()].sort((a, b) => a - b);
    const x = ranks.map((r) => "rank " + r);
    const y = (i) => ranks.map((r) => per.get(r)[i] / per.get(r)[3]);
    Plotly.react("ranks", [
      {type: "bar", name: "data wait", x, y: y(0), marker: {color: "#e4572e"}},
      {type: "bar", name: "compute", x, y: y(1), marker: {color: "#29335c"}},
      {type: "bar", name: "communication", x, y: y(2), marker: {color: "#f3a712"}},
    ], layout({barmode: "stack", yaxis: {title: "seconds (mean)"}}), {displayModeBar: false});
  }

  function drawHeatmap() {
    if (!$("heatmap")) return;
    const rows = [...gpus.values()];
    const hosts = [...new Set(rows.map((r) => r[0]))].sort();
    const width = Math.max(1, ...rows.map((r) => r[1] + 1));
    const z = hosts.map(() => Array(width).fill(null));
    const hi = new Map(hosts.map((h, i) => [h, i]));
    for (const r of rows) z[hi.get(r[0])][r[1]] = r[3];
    Plotly.react("heatmap", [{type: "heatmap", z, x: [...Array(width).keys()].map((i) => "GPU " + i), y: hosts,
      zmin: 0, zmax: 100, colorscale: "Viridis", colorbar: {title: "util %"}}],
      layout({margin: {l: 110, r: 10, t: 10, b: 30}, height: Math.max(220, 24 * hosts.length + 60)}), {displayModeBar: false});
  }

  function drawLists() {
    const ev = $("events");
    if (ev) ev.innerHTML = events.map((e) => `<li class="sev-${esc(e.severity)}"><b>${esc(e.host)}</b> ${esc(e.kind)}${e.code !== null ? " " + esc(e.code) : ""}: ${esc(e.message)}</li>`).join("") || '<li class="muted">No warnings.</li>';
    const fl = $("findings");
    if (fl) fl.innerHTML = findings.map((f) => `<li class="sev-${esc(f.severity)}"><b>${esc(f.title)}</b><br><span class="muted">${esc(f.subject)}</span><br>${esc(f.action || "")}</li>`).join("") || '<li class="muted">None open.</li>';
  }

  function render() {
    if (dirty) {
      dirty = false;
      drawSteps(); drawRanks(); drawHeatmap(); drawLists();
    }
    setTimeout(() => requestAnimationFrame(render), 250);
  }

  function explain(step) {
    const box = $("explain");
    if (!box || !cfg.run) return;
    box.hidden = false;
    $("explain-step").textContent = step;
    const rows = [...(steps.get(step) || new Map()).values()].sort((a, b) => a[1] - b[1]);
    const x = rows.map((r) => "rank " + r[1]);
    Plotly.react("explain-body", [
      {type: "bar", name: "data wait", x, y: rows.map((r) => r[4]), marker: {color: "#e4572e"}},
      {type: "bar", name: "compute", x, y: rows.map((r) => r[5]), marker: {color: "#29335c"}},
      {type: "bar", name: "communication", x, y: rows.map((r) => r[6]), marker: {color: "#f3a712"}},
    ], layout({barmode: "stack", yaxis: {title: "seconds"}}), {displayModeBar: false});
    fetch(`/api/v1/runs/${cfg.run}/steps/${step}/explain`, {credentials: "same-origin"})
      .then((r) => (r.ok ? r.json() : null)).then((data) => {
        if (!data || !data.cause) return;
        const p = document.createElement("p");
        p.className = "verdict";
        p.textContent = `Most likely: ${data.cause.summary} (confidence ${Math.round(100 * data.cause.confidence)}%)`;
        $("explain-body").prepend(p);
      }).catch(() => {});
  }

  function connect(delay) {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(proto + location.host + cfg.ws);
    const status = $("live-status");
    ws.onopen = () => { if (status) { status.textContent = "live"; status.className = "pill ok"; } delay = 500; };
    ws.onmessage = (m) => onFrame(JSON.parse(m.data));
    ws.onclose = () => {
      if (status) { status.textContent = "reconnecting…"; status.className = "pill warn"; }
      setTimeout(() => connect(Math.min(delay * 2, 10000)), delay);
    };
  }

  document.addEventListener("DOMContentLoaded", () => {
    if (cfg.ws) connect(500);
    const chart = $("steps");
    if (chart) chart.addEventListener("plotly_click", () => {});
    requestAnimationFrame(render);
    if (chart) {
      // plotly attaches .on once the first plot exists.
      const hook = setInterval(() => {
        if (chart.on) { chart.on("plotly_click", (ev) => explain(ev.points[0].x)); clearInterval(hook); }
      }, 300);
    }
  });
})();
