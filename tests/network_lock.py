"""Changes to this host's network, kept apart from the browser tests across the suite's processes.

Chromium fails its requests with ``net::ERR_NETWORK_CHANGED`` when an address of the host's network namespace comes
or goes (its NetworkChangeNotifier listens on netlink): the ones waiting for a connection, which a page load has
plenty of (a page's module scripts, more than the six connections a host gets). The testbed (``tests/netns``) adds
its bridge's address in the host's namespace and removes it, in a test process that runs beside the browser tests'
(scripts/test.sh): CI saw a run page's ``run.js`` and ``run_nccl.js`` fail that way, and a node page's table never
drew. Measured here: twelve fetches at once, six times over, all failed while a bridge's address came and went
every second, none while links alone did, none without either. So a browser holds this lock shared while it runs,
and a change of the host's addresses takes it exclusive, keeping it a moment after (Chromium hears of a change after
the ``ip`` command has returned).

A lock file's ``flock``: shared by every process of the machine, released when its holder exits, however it exits.
One process never holds both kinds (no test drives a browser and builds a testbed).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_PATH = Path(tempfile.gettempdir()) / "clusterdx-tests-host-network.lock"
SETTLE_S = 1.0  # how long Chromium may take to hear of a change
WAIT_S = 300.0  # a holder stuck past this (a hung test) is waited for no longer: the suite goes on, as before the lock


@contextlib.contextmanager
def _held(kind: int, what: str) -> Iterator[None]:
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    print(f"!! {what}: {LOCK_PATH} still held after {WAIT_S:.0f} s; going on without it",
                          file=sys.stderr)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def browsing() -> Iterator[None]:
    """While a browser runs: no testbed changes the host's network."""
    with _held(fcntl.LOCK_SH, "browser"):
        yield


@contextlib.contextmanager
def changing() -> Iterator[None]:
    """Around a change to the host's network namespace: no browser runs meanwhile, nor for SETTLE_S after."""
    with _held(fcntl.LOCK_EX, "host network change"):
        try:
            yield
        finally:
            time.sleep(SETTLE_S)
