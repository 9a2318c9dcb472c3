"""Since when this server has been listening for the agents without a break.

A node's silence is measured from its newest sample to the server's clock; but while the server itself was down,
nothing could be heard, whatever the nodes did. Restarted after seven minutes, the first pass (2 s after start, before
any agent's next post) named the whole cluster silent for 426 s, critical, and took it back 30 s later: a page after
every restart longer than the heartbeat. So every web worker beats here while it serves, and the pass measures a
silence from the later of the node's newest word and the start of the current stretch of listening
(``Window.listening_since``): a cluster or a node is judged silent only once this server has listened long enough to
have heard it.

The beats go through Django's cache: Redis in production, where the web workers and the Celery worker that runs
the pass are separate processes; the process's own memory embedded, where the server hands the value to its pass's
child process (:mod:`dashboard.diagnosis.offload`). A stretch ends when no worker has beaten for ``BREAK_S``: one
worker restarting beside another keeps it, the last one gone ends it.
"""

from __future__ import annotations

import logging
import threading
import time

from django.core.cache import cache

log = logging.getLogger(__name__)

KEY = "ingest:listening"
BEAT_S = 2.0
# No beat for this long is a break in listening. Well above BEAT_S: a beat delayed by a busy worker (its thread waits
# for the GIL) must not read as one, and a false break only holds a silence back for a heartbeat.
BREAK_S = 10.0


def beat(now: float | None = None) -> float:
    """This worker is listening at ``now``: extend the current stretch, or start one when none is running. Returns
    the stretch's start. Two workers starting together may each start one a few ms apart; the next beats agree."""
    now = time.time() if now is None else now
    start = _current(cache.get(KEY), now)
    start = now if start is None else start
    cache.set(KEY, (start, now), timeout=None)
    return start


def _current(got: tuple[float, float] | None, now: float) -> float | None:
    """The start of the stretch ``got`` (start, last beat) while it runs at ``now``. Either side of ``now``: another
    worker's clock (another machine's) may run a little ahead of this one's."""
    return float(got[0]) if got is not None and abs(now - float(got[1])) <= BREAK_S else None


def since(now: float | None = None) -> float | None:
    """When the current stretch of listening began; None when no worker has beaten within ``BREAK_S`` of ``now``
    (none is serving, or no server runs here at all: a pass run by hand, a test's): then a silence is the nodes'."""
    now = time.time() if now is None else now
    try:
        got = cache.get(KEY)
    except Exception:  # the cache (Redis) unreachable: judge as if always listening, as before this existed
        log.warning("cannot read when ingest began listening; silences are measured from the nodes' words alone")
        return None
    return _current(got, now)


def _beat_logged() -> None:
    try:
        beat()
    except Exception:  # Redis away for a moment: the next beat tries again (a long gap is a real break)
        log.warning("ingest listening beat failed", exc_info=True)


def keep_beating() -> threading.Event:
    """Beat now, then every ``BEAT_S`` on a thread of its own until the returned event is set (the worker's
    shutdown). The first beat before this returns, so before the worker accepts a connection: a pass between its
    start and a first beat on the thread read nobody listening and named the nodes silent for the time it was down
    (a pass beside the restarted server, PostgreSQL + Redis, 0.25 s after the start). A thread, not a task of the
    event loop: a cache call is blocking I/O, and Django's async cache methods run on the thread every sync view
    waits for."""
    _beat_logged()
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(BEAT_S):
            _beat_logged()

    threading.Thread(target=run, name="listening-beat", daemon=True).start()
    return stop
