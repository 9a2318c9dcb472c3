// The run page's NCCL panel: each rank's inter-node transport since the run began as a strip of cells in node order
// (one heatmap, not one element per rank: it stays light at thousands of ranks), the counts per class and per
// transport, the ranks on sockets linked, then the per-node table and the newest warnings.
import {esc, link, when} from "./lib/fmt.js";
import {layout, react} from "./lib/chart.js";

// By the API's class keys; sockets are red only where the cluster's interconnect says IB or RoCE was expected.
const COLOR = {socket: "#d62828", ib: "#f3a712", net: "#2a9d8f", ib_gdr: "#52b788", intra: "#669bbc", unknown: "#d9d9d9"};
const SOCKET_OK = "#8d6a9f";
const NET = {ib: "InfiniBand", roce: "RoCE", eth: "Ethernet (sockets expected)"};
const WRAP = 128;          // cells per row at most, once nodes share rows
const NODE_ROWS = 48;      // up to this many nodes, one row per node (labelled)
const MAX_PER_NODE = 64;   // a node block wider than this is wrapped with the rest

const colorOf = (c, n) => (c.key === "socket" && !n.socket_expected ? SOCKET_OK : COLOR[c.key] || "#999");

// Rows of cells (indexes into the API's node-ordered columns, null for padding). Few nodes: a row per node. Many:
// several nodes per row, each in a block as wide as the largest node, so a column is a local rank and a sick node
// is a short bar. Nodes of very many ranks: the ranks wrapped WRAP to a row.
function grid(r) {
  const width = Math.max(1, ...r.nodes.map((nd) => nd.count));
  const block = (nd) => [...Array(width).keys()].map((k) => (k < nd.count ? nd.first + k : null));
  if (r.nodes.length <= NODE_ROWS && width <= MAX_PER_NODE) {
    return {rows: r.nodes.map((nd) => ({label: nd.host || "(no node)", cells: block(nd)})), width, block: width, title: "rank on the node"};
  }
  if (width <= MAX_PER_NODE) {
    const per = Math.max(1, Math.floor(WRAP / width));
    const rows = [];
    for (let i = 0; i < r.nodes.length; i += per) {
      const nodes = r.nodes.slice(i, i + per);
      rows.push({label: `${nodes[0].host || "?"} – ${nodes[nodes.length - 1].host || "?"}`, cells: nodes.flatMap(block)});
    }
    return {rows, width: Math.min(r.nodes.length, per) * width, block: width, title: `nodes in order, ${per} to a row; ${width} ranks each`};
  }
  const rows = [];
  for (let i = 0; i < r.order.length; i += WRAP) {
    rows.push({label: `rank ${r.order[i]}…`, cells: [...Array(Math.min(WRAP, r.order.length - i)).keys()].map((k) => i + k)});
  }
  return {rows, width: Math.min(WRAP, r.order.length), block: 0, title: "ranks in node order"};
}

let cellRank = [];  // [row][col] -> rank, for clicks

function drawStrip(n) {
  const r = n.ranks;
  const g = grid(r);
  const classes = r.classes;
  const k = classes.length;
  const host = new Array(r.order.length);
  for (const nd of r.nodes) host.fill(nd.host || "?", nd.first, nd.first + nd.count);
  // A discrete colour scale: class i fills [i/k, (i+1)/k].
  const scale = classes.flatMap((c, i) => [[i / k, colorOf(c, n)], [(i + 1) / k, colorOf(c, n)]]);
  const pad = (row, f) => [...row.cells.map((i) => (i === null ? null : f(i))), ...Array(g.width - row.cells.length).fill(null)];
  const z = g.rows.map((row) => pad(row, (i) => r.cls[i] + 0.5));
  const text = g.rows.map((row) => pad(row, (i) => `rank ${r.order[i]} · ${host[i]}<br>${classes[r.cls[i]].label}<br>${r.combos[r.combo[i]]}`));
  cellRank = g.rows.map((row) => row.cells.map((i) => (i === null ? undefined : r.order[i])));
  const cell = Math.max(3, Math.min(22, 420 / g.rows.length));
  // A few cells per node would stretch into long bars across the card: keep them near square.
  document.getElementById("nccl-strip").style.maxWidth = g.width <= 16 ? `${Math.max(420, 170 + 40 * g.width)}px` : "";
  // Lines between the node blocks of a row.
  const shapes = g.block && g.width > g.block ? [...Array(g.width / g.block - 1).keys()].map((b) => ({type: "line", xref: "x", yref: "paper",
    x0: (b + 1) * g.block - 0.5, x1: (b + 1) * g.block - 0.5, y0: 0, y1: 1, line: {color: "#fff", width: 2}})) : [];
  const every = Math.ceil(g.rows.length / 32);  // at most ~32 row labels
  const labels = g.rows.map((row) => row.label);
  react("nccl-strip", [{type: "heatmap", z, text, hovertemplate: "%{text}<extra></extra>", zmin: 0, zmax: k,
    colorscale: scale, showscale: false, xgap: g.width <= 64 ? 1 : 0, ygap: g.rows.length <= 64 ? 1 : 0}],
  layout({hovermode: "closest", height: 60 + cell * g.rows.length, margin: {l: 150, r: 10, t: 5, b: 50}, shapes,
    xaxis: {title: {text: g.title, standoff: 4}, showgrid: false, zeroline: false, ...(g.width <= 16 ? {tickmode: "linear", dtick: 1} : {})},
    yaxis: {type: "category", categoryarray: labels, autorange: "reversed", tickmode: "array",
      tickvals: labels.filter((_, i) => i % every === 0), automargin: true, showgrid: false, ticks: ""},
  }));
}

function summary(n) {
  const r = n.ranks;
  const total = r.order.length;
  const pill = (c) => `<span class="nccl-class${c.suspect ? " suspect" : ""}"><i style="background:${colorOf(c, n)}"></i>${esc(c.label)}
    <b>${c.ranks}</b>${c.suspect ? ' <span class="muted">(IB/RoCE expected)</span>' : ""}</span>`;
  const tr = Object.entries(r.transports).map(([t, c]) => `${esc(t)} <b>${c}</b>`).join(" · ") || "none yet";
  const shown = r.socket.slice(0, 32);  // the API lists up to 200; the rest are a click on the strip away
  const sockets = shown.map((s) => `${link(s.url, "rank " + s.rank)} <span class="muted">${link(s.node_url, s.host || "?")}</span>`).join(", ");
  return `<p class="nccl-classes">${r.classes.filter((c) => c.ranks).map(pill).join("")}</p>
    <p class="muted">${total} ranks · ranks per transport: ${tr} · interconnect: ${esc(NET[n.interconnect] || n.interconnect)}</p>
    ${r.socket_count ? `<p class="nccl-socket ${n.socket_expected ? "bad" : ""}"><b>On TCP sockets:</b> ${sockets}${r.socket_count > shown.length
      ? ` <span class="muted">and ${r.socket_count - shown.length} more</span>` : ""}</p>` : ""}`;
}

function nodeTable(n) {
  const shown = n.nodes.slice(0, 200);
  const list = (a) => esc(a.join(", ") || "–");
  return `<table class="data nccl-nodes"><tr><th>node</th><th class="num">ranks</th><th>transport</th><th>network</th><th>GDR</th><th>env</th><th class="num">warnings</th></tr>
    ${shown.map((r) => `<tr class="${r.suspect ? "drift" : ""}"><td>${link(r.url, r.host)}</td><td class="num">${r.n_ranks}</td><td>${list(r.transports)}</td>
    <td>${list(r.networks)}</td><td>${list(r.gdr)}</td><td>${list([...r.env, ...r.facts])}</td><td class="num">${r.warnings}</td></tr>`).join("")}</table>
    ${n.nodes.length > shown.length ? `<p class="muted">and ${n.nodes.length - shown.length} more nodes, none suspect</p>` : ""}`;
}

function warningList(n) {
  return `<ul class="events">${n.warnings.map((e) => `<li class="sev-${esc(e.severity)}">
    <span class="muted">${esc(when(e.ts))}</span> ${link(e.node_url, e.host || "?")}${e.rank !== null ? " " + link(e.rank_url, "rank " + e.rank) : ""}: ${esc(e.message)}</li>`).join("")
    || '<li class="muted">No NCCL warnings.</li>'}</ul>`;
}

// Draws the panel into #nccl; `go(url)` is called with the page of a clicked cell's rank.
export function drawNccl(n, go) {
  const root = document.getElementById("nccl");
  if (!document.getElementById("nccl-strip")) {
    root.innerHTML = `<div id="nccl-summary"></div><div id="nccl-strip" class="chart small"></div>
      <div class="grid"><div><h3>Per node</h3><div id="nccl-nodes"></div></div><div><h3>Warnings <span class="muted">newest first</span></h3><div id="nccl-warnings"></div></div></div>`;
  }
  document.getElementById("nccl-summary").innerHTML = n.ranks.order.length ? summary(n)
    : '<p class="muted">No rank has reported yet: the strip needs the training hooks (ranks and their nodes).</p>';
  if (n.ranks.order.length) drawStrip(n);
  document.getElementById("nccl-nodes").innerHTML = nodeTable(n);
  document.getElementById("nccl-warnings").innerHTML = warningList(n);
  const strip = document.getElementById("nccl-strip");
  if (!strip.on && n.ranks.order.length) { // drawn before plotly had run: click handling once it has
    window.addEventListener("cdx:plotly", () => drawNccl(n, go), {once: true});
  }
  if (strip.on && !strip.dataset.clicks) {
    strip.dataset.clicks = "1";
    strip.on("plotly_click", (ev) => {
      const p = ev.points[0];
      const [row, col] = Array.isArray(p.pointNumber) ? p.pointNumber : [p.pointIndex?.[0], p.pointIndex?.[1]];
      const rank = (cellRank[row] || [])[col];
      if (rank !== undefined) go(`${n.ranks.rank_url_prefix}${rank}/`);
    });
  }
  document.body.dataset.ncclRanks = String(n.ranks.order.length);
}
