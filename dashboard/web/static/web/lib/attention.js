// Who is on a finding: "acked by X" and "silenced until T" pills, the same on every page that lists findings.
// Rows carry acked_by / acked_at (the finding's own) and silenced ({until, reason, by}, or null) from the server.
import {esc, when} from "./fmt.js";

export function badges(f) {
  const out = [];
  if (f.acked_by) out.push(`<span class="pill acked" title="acknowledged ${esc(when(f.acked_at))}">acked by ${esc(f.acked_by)}</span>`);
  if (f.silenced) {
    out.push(`<span class="pill silenced" title="${esc(f.silenced.reason)} (${esc(f.silenced.by)})">silenced until ${esc(when(f.silenced.until))}</span>`);
  }
  return out.join(" ");
}

// A live row keeps the silence mark it had when the frame that carried it did not say (older producers).
export const keepMarks = (old, row) => ("silenced" in row || !old ? row : {...row, silenced: old.silenced});
