"""A worker process's diagnosis pass goes first (dashboard.turns): its background tasks (the probe index, the
efficiency figures) wait between chunks while a pass runs, and go on when it ends."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
from django.db import connections

from dashboard import turns
from dashboard.storage import probe_index
from dashboard.telemetry.models import Node, ProbeInbound
from tests.server import framed


def test_a_background_chunk_waits_while_a_pass_runs_and_goes_on_when_it_ends() -> None:
    assert turns.yield_to_urgent() == 0.0  # no pass: no wait
    done = threading.Event()

    def background() -> None:
        turns.yield_to_urgent()
        done.set()

    with turns.urgent():
        with turns.urgent():  # two at once (threads of one test process): the last one's end frees the others
            t = threading.Thread(target=background)
            t.start()
            assert not done.wait(0.3)
        assert not done.wait(0.2)
    assert done.wait(5)
    t.join()


def test_a_pass_that_never_ends_holds_a_chunk_back_for_the_bound_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "MAX_YIELD_S", 0.2)
    with turns.urgent():
        t0 = time.monotonic()
        waited = turns.yield_to_urgent()
    assert 0.15 <= waited <= time.monotonic() - t0 < 5


@pytest.mark.django_db(transaction=True)  # the index pass runs in a thread of its own, on its own connection
def test_the_probe_index_waits_for_a_pass_then_lists_every_frame(world: Any) -> None:
    nodes = [Node.objects.create(cluster=world.cluster, hostname=f"t-{i}") for i in range(3)]
    t0 = math.floor(time.time() / 60) * 60 - 120
    for s in range(0, 60, 5):
        for i, node in enumerate(nodes):
            framed.probes(world.cluster, node, [{"ts": t0 + s, "peer": nodes[(i + 1) % 3].hostname, "sent": 5,
                                                 "lost": 0, "rtt_ms": 0.2}])
    written: list[int] = []

    def index() -> None:
        try:
            written.append(probe_index.update())
        finally:
            connections.close_all()

    with turns.urgent():
        t = threading.Thread(target=index)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not ProbeInbound.objects.exists()  # held at its first chunk while the pass runs
    t.join(30)
    assert written and written[0] > 0
    assert set(ProbeInbound.objects.values_list("peer", flat=True)) == {n.hostname for n in nodes}


def test_a_diagnosis_tick_runs_as_urgent_and_frees_the_turn_after(monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard.diagnosis import tasks

    clear_during: list[bool] = []
    monkeypatch.setattr(tasks, "_diagnose", lambda: clear_during.append(turns._clear.is_set()) or {})
    tasks.diagnose()
    assert clear_during == [False] and turns._clear.is_set()
