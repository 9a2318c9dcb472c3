// The findings list of a cluster: the GET form's query (the page URL) drives /api/v1/findings; a table of links,
// pages of PAGE rows, and new or changed findings from the live stream prepended when they match the filters.
import {esc, when, age, link, $, pageData} from "./lib/fmt.js";
import {connectLive} from "./lib/live.js";
import {badges, keepMarks} from "./lib/attention.js";

const DATA = pageData();
const PAGE = 50;
const FILTERS = ["state", "kind", "severity", "node", "run"];
const form = $("filters");
const query = new URLSearchParams(location.search);
const offset = Math.max(0, parseInt(query.get("offset") || "0", 10) || 0);
let rows = [];
let total = 0;

// The form's values from the URL, so a filtered list is a link and a reload keeps it.
function fillForm() {
  for (const name of [...FILTERS, "within"]) if (query.get(name)) form.elements[name].value = query.get(name);
  const local = (ts) => { const d = new Date(ts * 1000); return new Date(d - d.getTimezoneOffset() * 60000).toISOString().slice(0, 16); };
  if (query.get("since") && !query.get("within")) form.elements.within.value = "custom";
  if (query.get("since")) form.elements.since_local.value = local(+query.get("since"));
  if (query.get("until")) form.elements.until_local.value = local(+query.get("until"));
  showCustom();
}

function showCustom() {
  document.querySelectorAll(".custom-time").forEach((el) => { el.hidden = form.elements.within.value !== "custom"; });
}

// On submit: keep the filters that are set, turn the time choice into since/until (epoch seconds, what the API takes).
form.addEventListener("change", (ev) => { if (ev.target.name === "within") showCustom(); });
form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = new URLSearchParams();
  for (const name of FILTERS) if (form.elements[name].value) q.set(name, form.elements[name].value.trim());
  const within = form.elements.within.value;
  if (within === "custom") {
    const s = form.elements.since_local.value, u = form.elements.until_local.value;
    if (s) q.set("since", String(Date.parse(s) / 1000));
    if (u) q.set("until", String(Date.parse(u) / 1000));
  } else if (within) q.set("within", within);
  location.search = q.toString();
});

function apiQuery(extra = {}) {
  const q = new URLSearchParams({cluster: DATA.cluster, limit: String(PAGE), offset: String(offset)});
  for (const name of FILTERS) if (query.get(name)) q.set(name, query.get(name));
  if (query.get("within")) q.set("since", String(Math.floor(Date.now() / 1000 - Number(query.get("within")))));
  for (const name of ["since", "until"]) if (query.get(name)) q.set(name, query.get(name));
  for (const [k, v] of Object.entries(extra)) q.set(k, v);
  return q;
}

function rowHtml(f, fresh = false) {
  return `<tr data-id="${esc(f.id)}" class="sev-${esc(f.severity)}${fresh ? " fresh" : ""}">
    <td><span class="sev ${esc(f.severity)}">${esc(f.severity)}</span></td>
    <td class="state-${esc(f.state)}">${esc(f.state)}</td>
    <td>${link(f.url, f.title)} ${badges(f)}</td><td>${link(f.subject_url, f.subject)}</td>
    <td class="headline">${esc(f.headline || "")}</td><td>${esc(f.kind)}</td>
    <td title="${esc(when(f.opened_at))}">${esc(age(f.opened_at))} ago</td><td>${esc(when(f.updated_at))}</td></tr>`;
}

function render() {
  const body = $("list").querySelector("tbody");
  body.innerHTML = rows.length ? rows.map((r) => rowHtml(r, r._fresh)).join("")
    : `<tr><td colspan="8" class="empty">No finding matches these filters.</td></tr>`;
  rows.forEach((r) => { r._fresh = false; }); // highlighted once, when it arrived
  $("total").textContent = `${total} finding${total === 1 ? "" : "s"}`;
  const pages = Math.max(1, Math.ceil(total / PAGE));
  const at = Math.floor(offset / PAGE) + 1;
  const to = (o) => { const q = new URLSearchParams(location.search); q.set("offset", String(o)); return "?" + q.toString(); };
  $("pager").innerHTML = pages > 1 ? [
    offset > 0 ? `<a rel="prev" href="${esc(to(Math.max(0, offset - PAGE)))}">← newer</a>` : "<span></span>",
    `<span class="muted">page ${at} of ${pages}</span>`,
    offset + PAGE < total ? `<a rel="next" href="${esc(to(offset + PAGE))}">older →</a>` : "<span></span>",
  ].join(" ") : "";
}

async function load() {
  const r = await fetch(`${DATA.api}?${apiQuery()}`, {credentials: "same-origin", headers: {Accept: "application/json"}});
  const body = await r.json();
  if (!r.ok) {
    $("error").hidden = false;
    $("error").textContent = `The filters were refused: ${body.detail || r.status}`;
    return;
  }
  rows = body.findings;
  total = Number(r.headers.get("X-Total-Count") || rows.length);
  render();
}

// A live row joins the list when it matches the filters (and the first page is shown); a known one is updated.
function matches(f) {
  for (const name of ["state", "kind", "severity"]) if (query.get(name) && f[name] !== query.get(name)) return false;
  if (query.get("run") && String(f.run) !== query.get("run")) return false;
  if (query.get("node") && f.node !== query.get("node") && !(f.subject || "").split("~").includes(query.get("node"))) return false;
  return !query.get("until");
}

function onFrame(frame) {
  if (frame.type !== "delta" || !frame.findings) return;
  let dirty = false;
  for (const f of frame.findings) {
    const i = rows.findIndex((r) => r.id === f.id);
    if (i >= 0) {
      if (!matches(f)) { rows.splice(i, 1); total -= 1; } else rows[i] = {...rows[i], ...keepMarks(rows[i], f), _fresh: true};
      dirty = true;
    } else if (offset === 0 && matches(f)) {
      rows.unshift({...f, _fresh: true});
      total += 1;
      dirty = true;
    }
  }
  if (dirty) { rows = rows.slice(0, PAGE); render(); }
}

// Silence end times are rendered as epoch seconds by the server: shown in the reader's own time zone.
document.querySelectorAll("#silences .epoch").forEach((el) => { el.textContent = when(Number(el.dataset.ts)); });
fillForm();
load().then(() => connectLive(DATA.ws, onFrame));
