"""Since when ingest has listened (dashboard.ingest.listening), through the deployment's cache: the process's memory
embedded, Redis in the PostgreSQL + Redis pass (where the web workers and the Celery worker share it)."""

from __future__ import annotations

import time

from dashboard.ingest import listening

T = 1_800_000_000.0


def test_beats_within_the_break_keep_one_stretch_and_a_gap_starts_another() -> None:
    assert listening.since(T) is None  # no server has listened
    assert listening.beat(T) == T
    for k in range(1, 30):  # every 2 s for a minute: one stretch
        assert listening.beat(T + 2.0 * k) == T
    assert listening.since(T + 58.0 + listening.BREAK_S) == T
    assert listening.since(T + 58.0 + listening.BREAK_S + 0.5) is None  # every worker gone: nobody listens
    assert listening.beat(T + 100.0) == T + 100.0  # the next server's stretch starts with it
    assert listening.since(T + 101.0) == T + 100.0


def test_a_worker_restarting_beside_another_keeps_the_stretch() -> None:
    listening.beat(T)
    for k in range(1, 10):  # two workers beat in turn; the first restarts at 6 s (no beat between 4 and 8)
        listening.beat(T + k)  # the second
        if not 4 < k < 8:
            listening.beat(T + k + 0.3)  # the first
    assert listening.since(T + 10.0) == T
    # A worker whose clock runs a little behind the other's does not break it either.
    assert listening.beat(T + 9.0) == T


def test_a_server_beats_while_it_serves(asgi_server: object) -> None:
    deadline = time.monotonic() + 5
    while listening.since() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    started = listening.since()
    assert started is not None and time.time() - 30 < started <= time.time()
    time.sleep(listening.BEAT_S + 0.5)
    assert listening.since() == started  # its beats extend the stretch
