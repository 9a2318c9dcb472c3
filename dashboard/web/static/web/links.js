// The link matrix: node x node heatmaps of probe RTT and bulk bandwidth, nodes ordered by switch / rack with
// separators between the groups, the diagnosis's bad pairs outlined, open network findings on top. A cell opens that
// pair's link page. The API sends the matrix sparse (coordinate lists); it is filled into a grid here.
import {$, age, esc, fmt, link, pageData} from "./lib/fmt.js";
import {CONFIG, layout, react} from "./lib/chart.js";
import {pollRange} from "./lib/poll.js";
import {rangeQuery} from "./lib/range.js";

const page = pageData();
const BIG = 600; // beyond this many nodes a dense heatmap grid costs more than square WebGL markers per probed pair

// Separators between switch / rack groups, and tick labels at each group's first node.
function groupShapes(m) {
  const n = m.nodes.length;
  const line = {color: "#29335c", width: 1.2};
  return m.groups.slice(1).flatMap((g) => [
    {type: "line", x0: g.start - 0.5, x1: g.start - 0.5, y0: -0.5, y1: n - 0.5, line},
    {type: "line", y0: g.start - 0.5, y1: g.start - 0.5, x0: -0.5, x1: n - 0.5, line},
  ]);
}

// A finding about a node outlines its row and column: the node the diagnosis blames, in the picture.
function findingShapes(m, index) {
  const n = m.nodes.length;
  const out = [];
  for (const f of m.findings) {
    for (const host of [f.node, f.peer]) {
      const k = index.get(host);
      if (k === undefined) continue;
      const line = {color: "#9d0208", width: 1.5, dash: "dot"};
      out.push({type: "rect", x0: -0.5, x1: n - 0.5, y0: k - 0.5, y1: k + 0.5, line});
      out.push({type: "rect", y0: -0.5, y1: n - 0.5, x0: k - 0.5, x1: k + 0.5, line});
    }
  }
  return out;
}

function axis(m, hosts) {
  const a = {type: "category", categoryorder: "array", categoryarray: hosts, showgrid: false, zeroline: false,
    tickfont: {size: 10}, automargin: true};
  if (hosts.length > 40 && m.groups.length) {
    a.tickmode = "array";
    a.tickvals = m.groups.map((g) => hosts[g.start]);
    a.ticktext = m.groups.map((g) => g.label);
  } else if (hosts.length > 40) {
    a.nticks = 20;
  }
  return a;
}

function matrixTrace(m, hosts, field, unit, colorscale, reverse) {
  const p = m.pairs;
  const vals = p[field];
  const colorbar = {title: {text: unit, side: "right"}, thickness: 12};
  const hover = `%{y} → %{x}<br>%{z:.3g} ${unit}<extra></extra>`;
  if (hosts.length > BIG) {
    const x = [], y = [], c = [];
    vals.forEach((v, k) => { if (v !== null) { x.push(hosts[p.j[k]]); y.push(hosts[p.i[k]]); c.push(v); } });
    return {type: "scattergl", mode: "markers", x, y, marker: {symbol: "square", size: 3, color: c, colorscale,
      reversescale: reverse, colorbar, showscale: true}, hovertemplate: hover.replace("%{z", "%{marker.color")};
  }
  const z = hosts.map(() => new Array(hosts.length).fill(null));
  vals.forEach((v, k) => { if (v !== null) z[p.i[k]][p.j[k]] = v; });
  return {type: "heatmap", x: hosts, y: hosts, z, colorscale, reversescale: reverse, colorbar, hoverongaps: false,
    hovertemplate: hover, xgap: hosts.length < 64 ? 1 : 0, ygap: hosts.length < 64 ? 1 : 0};
}

function badTrace(m, hosts, cell) {
  return {type: hosts.length > BIG ? "scattergl" : "scatter", mode: "markers", name: "bad pair", showlegend: false,
    x: m.bad.map((b) => hosts[b.j]), y: m.bad.map((b) => hosts[b.i]),
    text: m.bad.map((b) => b.why.join(", ")),
    hovertemplate: "%{y} → %{x}: bad (%{text})<extra></extra>",
    marker: {symbol: "square-open", size: cell, color: "#e4572e", line: {width: 2, color: "#e4572e"}}};
}

function drawMatrix(id, m, hosts, field, unit, colorscale, reverse, shapes) {
  const el = $(id);
  const side = Math.max(320, Math.min(el.clientWidth || 600, 760));
  const cell = Math.max(4, Math.min(24, (side - 140) / Math.max(1, hosts.length)));
  const lay = layout({height: side, hovermode: "closest", margin: {l: 90, r: 10, t: 10, b: 90},
    xaxis: {...axis(m, hosts), title: {text: "to (peer)"}, tickangle: -45},
    yaxis: {...axis(m, hosts), title: {text: "from (probing node)"}, autorange: "reversed"},
    shapes});
  react(el, [matrixTrace(m, hosts, field, unit, colorscale, reverse), badTrace(m, hosts, cell)], lay, CONFIG);
  if (!el.dataset.clicks) {
    el.dataset.clicks = "1";
    el.on("plotly_click", (ev) => {
      const pt = ev.points && ev.points[0];
      if (!pt || pt.y === pt.x || (pt.data.type === "heatmap" && pt.z === null)) return;
      const url = el._pairUrl.replace("{a}", encodeURIComponent(pt.y)).replace("{b}", encodeURIComponent(pt.x));
      location.href = `${url}?${rangeQuery(shown())}`;
    });
  }
  el._pairUrl = m.pair_url;
}

function drawFindings(m) {
  const ul = $("findings");
  if (!m.findings.length) { ul.innerHTML = '<li class="muted">No open network findings.</li>'; return; }
  ul.innerHTML = m.findings.map((f) => `<li class="sev-${esc(f.severity)}"><span class="sev ${esc(f.severity)}">` +
    `${esc(f.severity)}</span> ${link(f.url, f.title)} <span class="muted">· ${link(f.subject_url, f.subject)}` +
    ` · ${esc(f.kind)} · open ${age(f.opened_at)}</span></li>`).join("");
}

function drawBad(m) {
  const th = m.thresholds;
  $("rule").textContent = `RTT above ${fmt(th.rtt_ms, 3)} ms (${th.rtt_ratio}× the quiet ${fmt(th.baseline_rtt_ms, 3)} ms ` +
    `and ${th.rtt_abs_ms} ms over it; ${fmt(th.rtt_busy_ms, 2)} ms when a CPU is ${th.busy_cpu_pct}% busy), ` +
    `loss ≥ ${Math.round(th.loss_frac * 100)}%, bandwidth under ${fmt(th.bw_gbps, 1)} Gb/s ` +
    `(${Math.round(th.bw_ratio * 100)}% of the cluster's ${fmt(th.baseline_bw_gbps, 1)})`;
  const nodeUrl = new Map(m.nodes.map((n) => [n.host, n.url]));
  const rows = m.bad.slice(0, 200).map((b) => `<tr><td>${link(nodeUrl.get(b.from), b.from)}</td>` +
    `<td>${link(nodeUrl.get(b.to), b.to)}</td><td>${esc(b.why.join(", "))}</td><td class="num">${fmt(b.rtt_ms, 3)}</td>` +
    `<td class="num">${fmt(b.bw_gbps, 1)}</td><td class="num">${b.loss === null ? "–" : Math.round(b.loss * 100) + "%"}</td>` +
    `<td>${link(b.url + "?" + rangeQuery(shown()), "series")}</td></tr>`).join("");
  $("bad-pairs").innerHTML = m.bad.length ? `<table class="data"><thead><tr><th>from</th><th>to</th><th>why</th>` +
    `<th class="num">RTT ms</th><th class="num">bw Gb/s</th><th class="num">loss</th><th></th></tr></thead>` +
    `<tbody>${rows}</tbody></table>${m.bad.length > 200 ? `<p class="muted">${m.bad.length - 200} more…</p>` : ""}`
    : '<p class="empty">No bad pairs in this range.</p>';
}

function draw(m) {
  const hosts = m.nodes.map((n) => n.host);
  const index = new Map(hosts.map((h, k) => [h, k]));
  const shapes = [...groupShapes(m), ...findingShapes(m, index)];
  drawFindings(m);
  // plotly's YlOrRd runs dark red -> pale yellow: reversed, a slow RTT is dark red; as is, so is a narrow link.
  drawMatrix("rtt", m, hosts, "rtt_ms", "ms", "YlOrRd", true, shapes);
  drawMatrix("bw", m, hosts, "bw_gbps", "Gb/s", "YlOrRd", false, shapes);
  drawBad(m);
  const by = m.grouped_by ? ` · grouped by ${m.grouped_by}` : "";
  $("summary").textContent = `${hosts.length} nodes · ${m.pairs.i.length} probed pairs · ${m.bad.length} bad${by}` +
    (m.truncated ? " · too many probes in this range: showing part of it, narrow the range" : "") +
    ` · updated ${new Date().toLocaleTimeString()}`;
}

const shown = pollRange(page.api, draw, "15m");
