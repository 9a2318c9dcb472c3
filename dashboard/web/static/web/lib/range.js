// The time-range picker every time-series page has: 15 min, 1 h, 6 h, 24 h or a custom from/to. The choice lives in
// the URL (?range=1h or ?from=..&to=..) so a link or a reload shows the same window.
export const RANGES = ["15m", "1h", "6h", "24h"];

export function currentRange(fallback = "1h") {
  const q = new URLSearchParams(location.search);
  if (q.get("from")) return {from: q.get("from"), to: q.get("to") || ""};
  return {range: q.get("range") || fallback};
}

export function rangeQuery(r = currentRange()) {
  return r.from ? `from=${encodeURIComponent(r.from)}&to=${encodeURIComponent(r.to)}` : `range=${encodeURIComponent(r.range)}`;
}

// Renders the picker into `el` and calls onChange(range) on a change; returns the current range.
export function rangePicker(el, onChange, fallback = "1h") {
  let cur = currentRange(fallback);
  const local = (ts) => { const d = new Date(ts * 1000); return new Date(d - d.getTimezoneOffset() * 60000).toISOString().slice(0, 16); };
  function render() {
    el.innerHTML = RANGES.map((r) => `<button type="button" data-range="${r}" class="${cur.range === r ? "on" : ""}">${r}</button>`).join("") +
      `<span class="custom"><input type="datetime-local" name="from"> – <input type="datetime-local" name="to"><button type="button" data-custom>apply</button></span>`;
    if (cur.from) { el.querySelector("[name=from]").value = local(+cur.from); if (cur.to) el.querySelector("[name=to]").value = local(+cur.to); }
  }
  function set(r) {
    cur = r;
    const q = new URLSearchParams(location.search);
    ["range", "from", "to"].forEach((k) => q.delete(k));
    if (r.from) { q.set("from", r.from); if (r.to) q.set("to", r.to); } else q.set("range", r.range);
    history.replaceState(null, "", "?" + q.toString() + location.hash);
    render();
    onChange(r);
  }
  el.classList.add("range-picker");
  el.addEventListener("click", (ev) => {
    const b = ev.target.closest("button");
    if (!b) return;
    if (b.dataset.range) set({range: b.dataset.range});
    else if (b.hasAttribute("data-custom")) {
      const f = el.querySelector("[name=from]").value, t = el.querySelector("[name=to]").value;
      if (f) set({from: String(Date.parse(f) / 1000), to: t ? String(Date.parse(t) / 1000) : ""});
    }
  });
  render();
  return cur;
}

// Is the range "live" (ending now)? Live pages append websocket points only then.
export const isLive = (r) => !r.from || !r.to;
