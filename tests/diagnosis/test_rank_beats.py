"""Which rank stopped a run, from the ranks' beats (``detectors.ranks``): a four-rank run on four nodes steps every
0.5 s, then stops; each case sets where every rank says it is and how long ago it last said so."""

from __future__ import annotations

import dataclasses
from typing import Any

from dashboard.diagnosis.detectors import Detection, run_all
from dashboard.diagnosis.detectors.buffer import WindowBuffer

T0 = 1_760_000_000.0
LAST_STEP = T0 + 10.0


def diagnose(beats: dict[int, tuple[Any, ...]], stalled: float, events: dict[int, str] | None = None,
             silent_agents: tuple[int, ...] = (), late: float = 0.0) -> list[Detection]:
    """``beats``: rank -> (state, seconds since its last beat arrived[, seconds in that state]); ``events``: rank ->
    the error it died of; ``late``: how many seconds every node's batches take to reach the server."""
    buf, now = WindowBuffer(), LAST_STEP + stalled
    for n in range(4):
        meta = {"run": "r", "rank": n, "world_size": 4, "ts": T0, "host": f"node-{n}", "gpu_index": 0}
        steps = [{"run": "r", "rank": n, "step": s, "ts": T0 + 0.5 * (s + 1), "step_time_s": 0.5, "data_wait_s": 0.01,
                  "compute_s": 0.4, "comm_s": 0.09, "comm_arrive_s": 0.41} for s in range(20)]
        buf.add({"host": f"node-{n}", "sent_at": T0 + 10, "runs": [meta], "steps": steps})
    for rank, (state, age, *state_s) in beats.items():
        beat: dict[str, Any] = {"run": "r", "rank": rank, "ts": now - age, "state": state,
                                "state_s": state_s[0] if state_s else 1.0, "step": 19}
        err = [{"ts": now - age, "kind": "error", "run": "r", "rank": rank, "message": events[rank]}] \
            if events and rank in events else []
        buf.add({"host": f"node-{rank}", "sent_at": now - age, "beats": [beat], "events": err})
    for n in range(4):  # the agents: alive now, unless told otherwise
        heard = now - 10 if n in silent_agents else now
        buf.add({"host": f"node-{n}", "sent_at": heard, "hosts": [{"ts": heard, "cpu_pct": 10.0}]})
    w = buf.window(now)
    return run_all(dataclasses.replace(w, ingest_delay={f"node-{n}": late for n in range(4)}, ingest_lag_s=late)
                   if late else w)


def keys(found: list[Detection]) -> list[tuple[str, str]]:
    return [d.key for d in found]


def test_a_rank_gone_silent_while_the_others_wait_is_named_on_its_node() -> None:
    found = diagnose({0: ("step", 0.4), 1: ("step", 0.9), 2: ("step", 6.0), 3: ("step", 0.2)}, stalled=6)
    assert keys(found) == [("rank_down", "r/rank2")]
    d = found[0]
    assert (d.node, d.rank, d.subject_type, d.severity) == ("node-2", 2, "rank", "critical")
    assert d.evidence["metrics"]["silent_s"] == 6.0 and d.evidence["metrics"]["beats"] == {"step": 4}


def test_a_rank_going_quiet_is_waited_for_instead_of_naming_the_run() -> None:
    assert diagnose({0: ("step", 0.4), 1: ("step", 3.0), 2: ("step", 0.5), 3: ("step", 0.2)}, stalled=4) == []
    later = diagnose({0: ("step", 0.4), 1: ("step", 7.0), 2: ("step", 0.5), 3: ("step", 0.2)}, stalled=8)
    assert keys(later) == [("rank_down", "r/rank1")]


def test_every_rank_alive_and_stuck_is_a_hang_of_the_run() -> None:
    found = diagnose({r: ("step", 0.5) for r in range(4)}, stalled=6)
    assert keys(found) == [("hang", "r")]
    assert found[0].evidence["metrics"]["beats"] == {"step": 4}


def test_a_run_whose_ranks_all_finished_is_not_hung() -> None:
    # No GPU samples: without the beats, nothing would tell this run from a hung one.
    assert diagnose({r: ("finished", 5.0) for r in range(4)}, stalled=30) == []


def test_a_rank_that_crashed_of_its_own_error_is_named_with_the_error() -> None:
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    found = diagnose({0: ("step", 0.5), 1: ("crashed", 3.0), 2: ("step", 0.5), 3: ("step", 0.5)}, stalled=4,
                     events={1: oom})
    assert keys(found) == [("rank_down", "r/rank1")]
    assert "OutOfMemoryError" in found[0].title and found[0].evidence["metrics"]["error"] == oom


def test_survivors_that_died_of_the_lost_peer_are_not_blamed() -> None:
    reset = "RuntimeError: [pair.cc:534] Read error [10.77.1.3]:46829: Connection reset by peer"
    found = diagnose({0: ("crashed", 4.5), 1: ("crashed", 4.5), 2: ("step", 5.0), 3: ("crashed", 4.5)}, stalled=5,
                     events={0: reset, 1: reset, 3: reset})
    assert keys(found) == [("rank_down", "r/rank2")]
    m = found[0].evidence["metrics"]
    assert m["peer_errors"] == 3 and m["peer_addresses"] == ["10.77.1.3"]


def test_a_run_whose_survivors_died_of_a_lost_peer_is_not_hung_while_the_dead_ranks_last_beat_is_fresh() -> None:
    """The killed rank's last beat, sent just before the kill, arrived with its agent's next batch 1.3 s later (CI's
    testbed on loaded cores): 3 s into the stall it was 1.7 s old, not yet "going quiet", and the run was named
    hung beside the rank that stopped it. Until its beats go silent, nothing is named; then the rank."""
    reset = "RuntimeError: [pair.cc:553] Connection closed by peer [10.77.1.2]:22693"
    events = {0: reset, 2: reset, 3: reset}
    early = {0: ("crashed", 1.7), 1: ("step", 1.7, 0.0), 2: ("crashed", 1.7), 3: ("crashed", 0.8)}
    assert diagnose(early, stalled=3.0, events=events) == []
    later = {0: ("crashed", 4.8), 1: ("step", 4.8, 0.0), 2: ("crashed", 4.8), 3: ("crashed", 3.9)}
    assert keys(diagnose(later, stalled=6.1, events=events)) == [("rank_down", "r/rank1")]


def test_a_rank_that_left_the_loop_while_the_others_wait_is_named() -> None:
    found = diagnose({0: ("finished", 3.0), 1: ("step", 0.5), 2: ("step", 0.5), 3: ("step", 0.5)}, stalled=6)
    assert keys(found) == [("rank_down", "r/rank0")]
    assert "left the training loop" in found[0].title


def test_a_rank_stuck_fetching_data_is_the_hang_named_on_that_rank() -> None:
    found = diagnose({0: ("step", 0.5), 1: ("step", 0.5), 2: ("step", 0.5), 3: ("data", 0.5, 5.5)}, stalled=6)
    assert keys(found) == [("hang", "r/rank3")]
    assert (found[0].node, found[0].rank) == ("node-3", 3) and "next batch" in found[0].title
    # In 'data' for 1.5 s of a 6 s stall: a fetch that just began, not what stopped the run.
    brief = diagnose({0: ("step", 0.5), 1: ("step", 0.5), 2: ("step", 0.5), 3: ("data", 0.5, 1.0)}, stalled=6)
    assert keys(brief) == [("hang", "r")]


def test_a_silent_rank_on_a_silent_node_is_left_to_the_node() -> None:
    assert diagnose({0: ("step", 0.4), 1: ("step", 0.4), 2: ("step", 8.0), 3: ("step", 0.4)}, stalled=8,
                    silent_agents=(2,)) == []
