// Formatting and escaping shared by every page. Every string from the server goes through esc() before innerHTML.
export const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

export const fmt = (v, d = 2) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);

export function bytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// "3 s", "4 min", "2 h 5 min", "3 d" since an epoch-seconds timestamp.
export function age(ts, now = Date.now() / 1000) {
  if (ts === null || ts === undefined) return "–";
  const s = Math.max(0, now - ts);
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  return `${Math.round(s / 86400)} d`;
}

export const when = (ts) => (ts === null || ts === undefined) ? "–" : new Date(ts * 1000).toLocaleString();

// A link to a subject's page; the server gives every row its url, so pages never build paths themselves.
export const link = (url, text) => url ? `<a href="${esc(url)}">${esc(text)}</a>` : esc(text);

export const sevRank = {info: 0, warning: 1, error: 2, critical: 3};

export const $ = (id) => document.getElementById(id);

// The page's first data, rendered by the view into <script type="application/json" id="...">.
export function pageData(id = "page-data") {
  const el = document.getElementById(id);
  return el ? JSON.parse(el.textContent) : {};
}

export async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}
