// Pages whose data is not pushed over the websocket (probe matrices and series) re-read their API every `everyMs`
// while the range ends now, with the range picker on top and the state in the #live-status pill. Returns a getter
// of the range shown, for links that keep it.
import {$, getJSON} from "./fmt.js";
import {isLive, rangePicker, rangeQuery} from "./range.js";

function pill(text, cls) {
  const el = $("live-status");
  el.textContent = text;
  el.className = "pill " + cls;
}

export function pollRange(api, draw, fallbackRange, everyMs = 10000) {
  let timer = null;
  let loads = 0;
  let range = rangePicker($("range"), (r) => { range = r; load(); }, fallbackRange);
  async function load() {
    clearTimeout(timer);
    try {
      draw(await getJSON(`${api}?${rangeQuery(range)}`));
      loads += 1;
      document.body.dataset.loads = String(loads);
      pill(isLive(range) ? "live" : "fixed range", isLive(range) ? "ok" : "");
    } catch (err) {
      pill("error", "bad");
      console.warn(err);
    }
    if (isLive(range)) timer = setTimeout(load, everyMs);
  }
  load();
  return () => range;
}
