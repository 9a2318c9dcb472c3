"""Which rank stopped a run, from the ranks' beats.

Under DDP every rank stops stepping when one does, so step data alone names only the run. The hooks' shipping thread
sends a beat about once a second, also while the training thread is blocked in a collective or a data fetch: a
killed or frozen rank goes silent while the others keep beating from inside the all-reduce; a rank whose input
pipeline is stuck says ``data`` while the others say ``step``; a rank that dies of an exception says ``crashed``
(and its error names the cause, or the peer that vanished); a clean close says ``finished``.

:func:`verdict` reads one run's beats and says which of those it is. The hang detector turns it into findings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dashboard.diagnosis.detectors.base import Detection, Thresholds, rnd
from dashboard.diagnosis.detectors.window import RunInfo, Window

TERMINAL = frozenset({"finished", "crashed"})
# Errors a survivor dies of when a *peer* vanished (gloo and NCCL): a consequence, never the cause.
_PEER_ERROR = re.compile(r"connection reset by peer|connection closed by peer|broken pipe|read error|"
                         r"remote process exited|ncclRemoteError|communicator was aborted|socket timeout", re.I)
_ADDR = re.compile(r"\[([0-9a-fA-F:.]+)\]:\d+")


@dataclass
class RankBeat:
    rank: int
    node: str | None
    state: str
    age_s: float  # since the server last received a beat from this rank
    state_s: float  # how long it has been in ``state``, as of now
    step: int | None
    pid: int | None = None
    error: dict[str, Any] | None = None  # the exception it died of, when it said
    agent: str | None = None  # the host whose agent forwarded its beats (named as the agents name themselves)


@dataclass
class Verdict:
    """``what``: "none" (no beats: old hooks), "finished", "silent" / "crashed" / "left" (``culprits`` stopped the
    run), "data" (``culprits`` are stuck fetching a batch), "wait" (a rank is going quiet: decide next pass), or
    "all" (every rank is alive and stuck: a deadlock)."""

    what: str
    culprits: list[RankBeat] = field(default_factory=list)
    beats: dict[int, RankBeat] = field(default_factory=dict)
    peer_errors: list[dict[str, Any]] = field(default_factory=list)

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.beats.values():
            out[b.state] = out.get(b.state, 0) + 1
        return out


def run_beats(w: Window, run: RunInfo) -> dict[int, RankBeat]:
    errors = {e["rank"]: e for e in w.events if e["kind"] == "error" and e["run"] == run.name and e["rank"] is not None}
    out = {}
    for b in w.beats:
        if b["run"] != run.name:
            continue
        rank = int(b["rank"])
        info = run.ranks.get(rank)
        age = max(0.0, w.now - float(b["received"]))
        out[rank] = RankBeat(rank, (info.node if info and info.node else None) or b.get("host"), b["state"], age,
                             float(b["state_s"]) + age, b.get("step"), b.get("pid"), errors.get(rank), b.get("host"))
    return out


def is_peer_error(e: dict[str, Any] | None) -> bool:
    return e is not None and bool(_PEER_ERROR.search(e.get("message") or ""))


def peer_address(e: dict[str, Any]) -> str | None:
    """The address a survivor's error names (gloo: "Read error [10.77.1.2]:46829: Connection reset by peer")."""
    m = _ADDR.search(e.get("message") or "")
    return m.group(1) if m else None


def verdict(w: Window, run: RunInfo, t: Thresholds, stalled: float, med: float, limit: float,
            alive_within_s: float) -> Verdict:
    """``stalled``: seconds since the run's last step; ``limit``: when that makes the run hung; ``med``: its median
    step (NaN when unknown)."""
    beats = run_beats(w, run)
    if not beats:
        return Verdict("none")
    v = Verdict("all", beats=beats)
    v.peer_errors = [b.error for b in beats.values() if b.state == "crashed" and is_peer_error(b.error)]
    if all(b.state in TERMINAL for b in beats.values()) and not any(b.state == "crashed" for b in beats.values()):
        v.what = "finished"
        return v
    alive = {h for h, heard in w.last_heard.items() if w.now - heard <= alive_within_s}
    live = [b for b in beats.values() if b.state not in TERMINAL and b.age_s < t.beat_silent_s]
    silent = [b for b in beats.values() if b.state not in TERMINAL and b.age_s >= t.beat_silent_s
              and (b.agent or b.node) in alive]
    crashed = [b for b in beats.values() if b.state == "crashed"]
    few = max(1, len(beats) // 2)
    # The run stopped with it: a rank whose beats are lost while the run steps on is not what stopped it.
    stopped = stalled >= (max(2.0 * med, t.beat_suspect_s) if med == med else t.beat_silent_s)
    if silent and len(silent) <= few and (live or crashed) and stopped:
        v.what, v.culprits = "silent", silent
        return v
    going = [b for b in beats.values() if b.state not in TERMINAL and b.age_s >= t.beat_suspect_s]
    if not going and crashed and len(v.peer_errors) == len(crashed):
        # The others died of a lost peer: one of the few left is that peer, dead, its last beat sent just before it
        # died and arriving with its agent's next batch (on the testbed's loaded cores 1.3 s after the kill, still
        # under beat_suspect_s when the run had not stepped for 3 s, and the run was named hung). A run whose ranks
        # crashed is not hung: they are all going quiet until the beats say which one went silent.
        going = [b for b in beats.values() if b.state != "crashed"]
    if going and (live or crashed) and len(going) <= few and stalled < limit + t.beat_silent_s:
        v.what = "wait"  # a rank is going quiet: naming the run now would open a finding for the wrong subject
        return v
    own = sorted((b for b in crashed if not is_peer_error(b.error)), key=lambda b: b.error["ts"] if b.error else 0)
    if own and stopped:
        v.what, v.culprits = "crashed", own[:1]
        return v
    if stalled < limit:
        return v
    waiting = [b for b in live if b.state == "step"]
    left = [b for b in beats.values() if b.state == "finished"]
    if left and waiting and len(left) <= few:
        v.what, v.culprits = "left", left
        return v
    stuck = [b for b in live if b.state == "data" and b.state_s >= 0.5 * stalled]
    if stuck and len(stuck) <= few and len(waiting) >= 0.5 * (len(beats) - len(stuck)):
        v.what, v.culprits = "data", stuck
    return v


# -- findings --------------------------------------------------------------------------------------------------------

def findings(w: Window, run: RunInfo, v: Verdict, stalled: float, med: float) -> list[Detection]:
    """``rank_down`` for each rank that stopped the run (silent, crashed, left early); ``hang`` on a rank whose
    input pipeline is stuck."""
    build = _stuck_loader if v.what == "data" else _rank_down
    return [build(w, run, v, b, stalled, med) for b in v.culprits]


def _metrics(v: Verdict, b: RankBeat, stalled: float, med: float, run: RunInfo) -> dict[str, Any]:
    addrs = sorted({a for e in v.peer_errors if (a := peer_address(e))})
    return {"state": b.state, "silent_s": rnd(b.age_s, 1), "state_s": rnd(b.state_s, 1), "pid": b.pid,
            "rank_last_step": b.step, "last_step": run.last_step, "stalled_s": rnd(stalled, 1),
            "median_step_s": rnd(med), "beats": v.states(), "error": (b.error or {}).get("message", "")[:500] or None,
            "peer_errors": len(v.peer_errors), "peer_addresses": addrs[:16],
            "peer_error": v.peer_errors[0]["message"][:300] if v.peer_errors else None}


def _rank_down(w: Window, run: RunInfo, v: Verdict, b: RankBeat, stalled: float, med: float) -> Detection:
    info = run.ranks.get(b.rank)
    on = f" on {b.node}" if b.node else ""
    pid = f" (pid {b.pid})" if b.pid else ""
    others = (f"{len(v.peer_errors)} other rank(s) then died of a lost peer ({v.peer_errors[0]['message'][:120]})"
              if v.peer_errors else "the other ranks keep beating from inside the collective, waiting for it")
    if v.what == "silent":
        title = f"Rank {b.rank}{on} stopped: no beat for {b.age_s:.0f} s while its node's agent is alive"
        action = (f"The process of rank {b.rank}{pid} is frozen or gone: its hooks stopped beating {b.age_s:.0f} s ago "
                  f"while {b.node or 'its node'}'s agent keeps reporting, and {others} → on {b.node or 'its node'}: "
                  f"`ps -o stat= -p {b.pid or '<pid>'}` (T: stopped, send SIGCONT or detach the debugger; D: stuck in "
                  "the kernel, check the filesystem and the GPU driver; gone: `dmesg` for the OOM killer or a "
                  "segfault), `py-spy dump` if it still runs; then restart the run from the last checkpoint.")
    elif v.what == "crashed":
        err = (b.error or {}).get("message", "an exception")
        title = f"Rank {b.rank}{on} crashed: {err[:160]}"
        action = (f"Rank {b.rank}{pid} died of {err[:300]}; the run cannot step without it → read the rank's traceback "
                  "in the job's log, fix the cause, and restart from the last checkpoint.")
    else:
        title = f"Rank {b.rank}{on} left the training loop while the other ranks wait in a collective"
        action = (f"Rank {b.rank} finished while the others still wait for it in a collective: the ranks did not get "
                  "the same number of batches → give every rank the same number of steps (DistributedSampler with "
                  "drop_last=True, or DDP's join() for uneven inputs), then restart from the last checkpoint.")
    return Detection(
        "rank_down", "rank", f"{run.name}/rank{b.rank}", "critical", title, action,
        {"metrics": _metrics(v, b, stalled, med, run), "window": [rnd(run.last_step_ts), rnd(w.now)]},
        0.95 if v.what == "silent" else 0.9, node=b.node, gpu_index=info.gpu if info else None, rank=b.rank,
        run=run.name)


def _stuck_loader(w: Window, run: RunInfo, v: Verdict, b: RankBeat, stalled: float, med: float) -> Detection:
    info = run.ranks.get(b.rank)
    dl = (info.meta.get("dataloader") or {}) if info else {}
    path = f" (dataset {dl['dataset_path']})" if dl.get("dataset_path") else ""
    on = f" on {b.node}" if b.node else ""
    return Detection(
        "hang", "rank", f"{run.name}/rank{b.rank}", "critical",
        f"{run.name} is hung: rank {b.rank}{on} has waited {b.state_s:.0f} s for its next batch",
        f"Rank {b.rank} is stuck fetching a batch{path} while the other ranks wait for it in the all-reduce → "
        f"`py-spy dump --pid {b.pid or '<pid>'}` on {b.node or 'its node'} to see where the input pipeline blocks "
        "(a dead DataLoader worker, a hung NFS read, a deadlocked collate or sampler); then restart from the last "
        "checkpoint.",
        {"metrics": {**_metrics(v, b, stalled, med, run), "dataloader": dl or None},
         "window": [rnd(run.last_step_ts), rnd(w.now)]},
        0.9, node=b.node, gpu_index=info.gpu if info else None, rank=b.rank, run=run.name)
