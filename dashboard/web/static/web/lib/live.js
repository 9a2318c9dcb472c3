// The one websocket client: connect, hand every frame to onFrame, reconnect with backoff, show the state in a pill.
// The server sends a snapshot on connect and merged deltas at most every CLUSTERDX_LIVE_FRAME_INTERVAL_MS.
export function connectLive(path, onFrame, statusId = "live-status") {
  let delay = 500;
  let frames = 0;
  const status = document.getElementById(statusId);
  const show = (text, cls) => { if (status) { status.textContent = text; status.className = "pill " + cls; } };
  function open() {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(proto + location.host + path);
    ws.onopen = () => { show("live", "ok"); delay = 500; };
    ws.onmessage = (m) => {
      frames += 1;
      document.body.dataset.frames = String(frames);
      onFrame(JSON.parse(m.data));
    };
    ws.onclose = (ev) => {
      if (ev.code === 4401 || ev.code === 4404) { show("no access", "bad"); return; }
      show("reconnecting…", "warn");
      setTimeout(open, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  open();
}

// Redraw at most every `ms`, only when something changed: live frames mark the page dirty, this draws at the next
// animation frame once `ms` have passed since the last draw (`draw` returns false when it had nothing to draw yet).
// (It polled every `ms` before, which held a page's first answer back by up to `ms` after its data had arrived.)
// Returns the function that marks the page dirty.
export function drawLoop(draw, ms = 250) {
  let dirty = false, scheduled = false, last = -Infinity;
  function run() {
    scheduled = false;
    if (!dirty) return;
    dirty = false;
    const before = last;
    last = performance.now();
    // A draw that had nothing to draw yet (its data or plotly still on the way) returns false and does not count:
    // counted, it held the first real draw back by up to `ms` after the data had arrived (~400 ms on the node page).
    if (draw() === false) last = before;
  }
  function mark() {
    dirty = true;
    if (scheduled) return;
    scheduled = true;
    setTimeout(() => requestAnimationFrame(run), Math.max(0, last + ms - performance.now()));
  }
  mark(); // a first draw with what the page has
  return mark;
}
