"""The test's side of a testbed scenario: what reached the server, the diagnosis pass, and what it saw.

``Watch.until(kind, subject)`` runs the same pass the schedule runs (``dashboard.diagnosis.tasks.run_pass``) about
once a second until a detection of that kind names that subject, and keeps every pass's detections so a test can
also check that nothing else was named. ``Watch.seen()`` summarises the window the detectors looked at (per-pair
probe RTT and bandwidth, per-rank data wait / compute / arrival, last steps, silence per node): printed on failure,
and the numbers behind each report.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from netns_testbed import Testbed

FAULT_KINDS = ("slow_link", "data_starvation", "straggler", "hang", "node_down", "rank_down")


@dataclass
class Outcome:
    detection: Any | None
    seconds: float  # from the fault to the first pass that named the subject
    passes: list[tuple[float, list[Any]]] = field(default_factory=list)  # (seconds since the fault, detections)

    def named(self, kinds: tuple[str, ...] = FAULT_KINDS) -> set[tuple[str, str]]:
        """(kind, subject) of every fault detection in any pass."""
        return {d.key for _, found in self.passes for d in found if d.kind in kinds}

    def last(self) -> list[Any]:
        return self.passes[-1][1] if self.passes else []


def wait_for(check: Callable[[], Any], timeout: float, what: str, bed: Testbed | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            logs = "" if bed is None else "\n".join(f"--- {n.name}:\n{bed.log(n.name + '.agent.log', 800)}\n"
                                                    f"{bed.log(n.name + '.rank.log', 1500)}" for n in bed.nodes)
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")
        time.sleep(0.25)


def probe_rounds(cluster: Any, since: float, bulk: bool = False) -> dict[str, int]:
    """node -> distinct seconds since ``since`` in which its agent reported probes (``bulk``: a bulk-bandwidth one)."""
    from dashboard.storage import frames as fr
    from dashboard.telemetry.models import Node

    probes = fr.read(fr.PROBES, t0=since, cols=("node_id",), cluster_id=cluster.id)
    if bulk:
        probes = probes.where(~np.isnan(probes["bw_gbps"]))
    hosts = dict(Node.objects.filter(cluster=cluster).values_list("id", "hostname"))
    out: dict[str, set[int]] = {}
    for node, ts in zip(probes["node_id"].tolist(), probes["ts"].tolist(), strict=True):
        out.setdefault(hosts[node], set()).add(int(ts))
    return {h: len(s) for h, s in out.items()}


class Watch:
    def __init__(self, cluster: Any, bed: Testbed, run: str) -> None:
        self.cluster, self.bed, self.run = cluster, bed, run

    # -- what arrived ----------------------------------------------------------------------------------------------
    def last_steps(self) -> dict[int, int]:
        from dashboard.storage import frames as fr

        steps = fr.read(fr.STEPS, cluster_id=self.cluster.id, run__name=self.run)
        last: dict[int, int] = {}
        for rank, step in zip(steps["rank"].astype(int).tolist(), steps["step"].astype(int).tolist(), strict=True):
            last[rank] = max(step, last.get(rank, step))
        return last

    def bulk_rounds_since(self, since: float) -> dict[str, int]:
        """node -> distinct seconds since ``since`` in which its agent reported a bulk-bandwidth probe."""
        return probe_rounds(self.cluster, since, bulk=True)

    def warm_up(self, steps: int = 24, rounds: int = 3, timeout: float = 60.0) -> dict[int, int]:
        """Until every rank made ``steps`` steps past its first, and then every agent made ``rounds`` bulk probe
        rounds: four ranks starting (importing torch, joining the job) saturate both cores for seconds, and probes
        measured through that are not what a healthy steady state looks like. The detectors judge a node on its last
        few rounds, so those must come after the start."""
        first = wait_for(lambda: (s := self.last_steps()) and len(s) == len(self.bed.nodes) and s, timeout,
                         "steps from every rank", self.bed)
        wait_for(lambda: (s := self.last_steps()) and min(s.values()) >= min(first.values()) + steps, timeout,
                 f"{steps} more steps", self.bed)
        settled = time.time()
        wait_for(lambda: (r := self.bulk_rounds_since(settled)) and len(r) == len(self.bed.nodes)
                 and min(r.values()) >= rounds, timeout, f"{rounds} bulk probe rounds from every agent", self.bed)
        return self.last_steps()

    # -- the diagnosis ---------------------------------------------------------------------------------------------
    def diagnose(self) -> list[Any]:
        from dashboard.diagnosis.tasks import run_pass

        return run_pass(self.cluster).detections

    def until(self, kind: str | tuple[str, ...], subject: str | set[str], since: float, timeout: float = 30.0,
              accept: Callable[[Any], bool] = lambda d: True) -> Outcome:
        """``accept``: a further condition on the detection (its evidence), checked at every pass."""
        kinds = (kind,) if isinstance(kind, str) else kind
        subjects = {subject} if isinstance(subject, str) else subject
        out = Outcome(None, float("nan"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            started = time.monotonic()
            found = self.diagnose()
            out.passes.append((time.time() - since, found))
            hit = next((d for d in found if d.kind in kinds and d.subject in subjects and accept(d)), None)
            if hit is not None:
                out.detection, out.seconds = hit, out.passes[-1][0]
                return out
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        return out

    def seen(self) -> str:
        """What the detectors see now, in numbers (for failure messages and the report)."""
        from dashboard.diagnosis.loader import load_window

        w = load_window(self.cluster, time.time())
        lines = [f"nodes={w.nodes} silent_s={ {h: round(w.now - t, 1) for h, t in w.last_heard.items()} }"]
        p = w.probes
        for a in range(len(w.nodes)):
            for b in range(len(w.nodes)):
                rows = (p["node"] == a) & (p["peer"] == b)
                if rows.any():
                    bw = p["bw_gbps"][rows][~np.isnan(p["bw_gbps"][rows])]
                    lines.append(f"  probe {w.nodes[a]}->{w.nodes[b]}: rtt_ms med "
                                 f"{np.nanmedian(p['rtt_ms'][rows]):.3f} max {np.nanmax(p['rtt_ms'][rows]):.3f}, "
                                 f"lost {int(np.nansum(p['lost'][rows]))}/{int(np.nansum(p['sent'][rows]))}, "
                                 f"bw_gbps {[round(float(x), 3) for x in bw[-4:]]}")
        for run in w.runs:
            lines.append(f"  run {run.name}: last_step {run.last_step}, stalled "
                         f"{w.now - (run.last_step_ts or w.now):.1f} s")
        for b in sorted(w.beats, key=lambda b: (b["run"], b["rank"])):
            lines.append(f"  beat {b['run']}/rank{b['rank']} on {b['host']}: {b['state']} for {b['state_s']:.1f} s, "
                         f"step {b.get('step')}, received {w.now - b['received']:.1f} s ago")
        s = w.steps
        for rank in sorted({int(r) for r in s["rank"]}) if len(s) else []:
            rows = s["rank"] == rank
            med = {c: statistics.median(float(x) for x in s[c][rows][-8:] if not np.isnan(x))
                   for c in ("step_time_s", "data_wait_s", "compute_s", "comm_s", "comm_arrive_s")
                   if np.any(~np.isnan(s[c][rows]))}
            lines.append(f"  rank {rank}: last step {int(np.nanmax(s['step'][rows]))}, medians of the last 8: "
                         + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
        lines += self.bed.links()
        return "\n".join(lines)


def describe(detection: Any) -> str:
    return f"{detection.kind} {detection.subject}: {detection.title} | {detection.evidence.get('metrics')}"


def check_named(watch: Watch, out: Outcome, expected: set[tuple[str, str]]) -> None:
    """The scenario named one of ``expected`` (kind, subject), and no pass named any other fault; what the window
    held is printed either way (and is the failure message)."""
    seen = watch.seen()
    print(f"[{watch.run}] named after {out.seconds:.1f} s in {len(out.passes)} pass(es): "
          f"{describe(out.detection) if out.detection else None}\n{seen}")
    assert out.detection is not None, f"never named {expected} in {len(out.passes)} passes; last pass: " \
        f"{[describe(d) for d in out.last()]}\n{seen}"
    wrong = [f"after {at:.1f} s: {describe(d)}" for at, found in out.passes for d in found
             if d.kind in FAULT_KINDS and d.key not in expected]
    assert not wrong, "also named:\n" + "\n".join(wrong) + f"\n{seen}"
