"""Every event type the browser receives, with its schema. ``check_event`` runs on every broadcast, and the tests
check each frame the websocket sends against :data:`FRAME_SCHEMA`."""

from __future__ import annotations

from typing import Any

# type -> {key: python type}. Row layouts are documented next to the producer (dashboard.live.publish).
EVENT_KEYS: dict[str, dict[str, type]] = {
    # [step, rank, ts, step_time_s, data_wait_s, compute_s, comm_s, tokens]
    "steps": {"run": int, "steps": list},
    # [host, gpu_index, ts, util_gpu_pct, mem_used_bytes, power_w, temp_c]
    "gpus": {"cluster": int, "gpus": list},
    # {id, ts, host, kind, severity, code, message}
    "events": {"cluster": int, "events": list},
    # {id, kind, state, severity, subject, title, action, opened_at, updated_at}
    "findings": {"cluster": int, "findings": list},
}

STEP_ROW = ["step", "rank", "ts", "step_time_s", "data_wait_s", "compute_s", "comm_s", "tokens"]
# The run snapshot's run.recent.rows: one row per step, over the ranks that reported it (means; the max step time;
# tokens summed). The snapshot sends these instead of ranks x steps rows, so its size does not grow with ranks.
STEP_AGG_ROW = ["step", "ts", "ranks", "step_time_s", "step_time_max_s", "data_wait_s", "compute_s", "comm_s",
                "tokens"]
GPU_ROW = ["host", "gpu_index", "ts", "util_gpu_pct", "mem_used_bytes", "power_w", "temp_c"]

# A frame is what one websocket message carries: a snapshot on connect, then deltas.
FRAME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "seq"],
    "properties": {
        "type": {"enum": ["snapshot", "delta"]},
        "seq": {"type": "integer", "minimum": 0},
        "run": {"type": ["object", "null"], "properties": {
            "id": {"type": "integer"}, "ranks": {"type": "integer"},
            "recent": {"type": "object", "required": ["columns", "rows"], "properties": {
                "columns": {"const": STEP_AGG_ROW},
                "rows": {"type": "array", "items": {"type": "array", "minItems": len(STEP_AGG_ROW),
                                                    "maxItems": len(STEP_AGG_ROW)}}}}}},
        "steps": {"type": "array", "items": {"type": "array", "minItems": len(STEP_ROW), "maxItems": len(STEP_ROW)}},
        "gpus": {"type": "array", "items": {"type": "array", "minItems": len(GPU_ROW), "maxItems": len(GPU_ROW)}},
        "events": {"type": "array", "items": {"type": "object"}},
        "findings": {"type": "array", "items": {"type": "object"}},
        "columns": {"type": "object"},
    },
    "additionalProperties": False,
}


def check_event(event: dict[str, Any]) -> None:
    kind = event.get("type")
    keys = EVENT_KEYS.get(kind)  # type: ignore[arg-type]
    if keys is None:
        raise ValueError(f"unknown live event type {kind!r}")
    for key, tp in keys.items():
        if not isinstance(event.get(key), tp):
            raise ValueError(f"live event {kind!r}: {key} must be {tp.__name__}")
