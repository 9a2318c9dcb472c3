"""After a batch commits: update the live state and broadcast what changed to the browsers that watch it."""

from __future__ import annotations

from typing import Any

from dashboard.live.broadcast import broadcast_all, cluster_group, run_group
from dashboard.live.state import get_state

SEVERE = {"warning", "error", "critical"}


def publish_batch(cluster_id: int, host: str, batch: dict[str, Any], runs: dict[str, int]) -> None:
    gpus = [
        [host, g["index"], g["ts"], g["util_gpu_pct"], g["mem_used_bytes"], g["power_w"], g["temp_c"]]
        for g in batch["gpus"]
    ]
    live = get_state()
    live.record(cluster_id, host, gpus)
    if batch["beats"]:
        # Only where each rank is now matters (the diagnosis reads it to name the rank that stopped a run).
        live.record_beats(cluster_id, host, batch["beats"])
    messages: list[tuple[str, dict[str, Any]]] = []
    if gpus:
        messages.append((cluster_group(cluster_id), {"type": "gpus", "cluster": cluster_id, "gpus": gpus}))
    by_run: dict[int, list[list[Any]]] = {}
    for s in batch["steps"]:
        by_run.setdefault(runs[s["run"]], []).append(
            [s["step"], s["rank"], s["ts"], s["step_time_s"], s["data_wait_s"], s["compute_s"], s["comm_s"], s["tokens"]]
        )
    for run_id, rows in by_run.items():
        messages.append((run_group(run_id), {"type": "steps", "run": run_id, "steps": rows}))
    events = [
        {"ts": e["ts"], "host": host, "kind": e["kind"], "severity": e["severity"], "code": e["code"],
         "gpu_index": e["gpu_index"], "message": e["message"][:500]}
        for e in batch["events"] if e["severity"] in SEVERE
    ]
    if events:
        messages.append((cluster_group(cluster_id), {"type": "events", "cluster": cluster_id, "events": events}))
    broadcast_all(messages)
