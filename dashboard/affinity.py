"""Each busy server process on a CPU of its own (``CLUSTERDX_PIN_CPU``).

A web worker runs several Python threads that take turns at one GIL: the event loop (HTTP, decoding the posts), the
group writer, the live publisher, the scheduler. Left to the kernel, they run on different CPUs, and every hand-over
of the GIL moves the interpreter's hot state (reference counts of shared objects, the allocator's pools) from one
core's cache to another's. Measured on this project's 2-core machine (``benchmarks/ingest_stages.py``), the same
posts' checks, stores and live updates cost one thread 0.24 ms a node-second alone, 0.78 ms with a second busy thread
in the process on the other CPU, and 0.30 ms with the two threads held to one CPU. In the whole server at 2,048 nodes
(``benchmarks/ingest.py``, alternated runs): 0.55 against 0.60 ms a node-second.

So each web worker (and the ingest writer process) claims one CPU of those it may run on and keeps all its threads
there: the GIL allows one of them at a time anyway. What runs beside them in processes of their own (the diagnosis
pass) runs on the CPUs no worker claimed (:func:`release`).

A claim is a name in Linux's abstract socket namespace, ``clusterdx-cpu-<n>``, bound as long as the process lives (the
kernel frees it when the process ends, however it ends): every clusterdx server process on the machine (in one
network namespace: one container) sees the others' claims, so N workers take N different CPUs, two servers beside
each other do not pile onto the first, and a restarted worker takes the CPU its predecessor left. Once every CPU is
claimed, a further process is not pinned. ``auto`` (the default) claims only where the claims see every server they
could collide with: on Linux, with two CPUs or more, and

- not under a CPU quota below the CPUs it sees (``docker run --cpus``, a Kubernetes CPU limit), and
- not in a container that sees the whole machine's CPUs (no cpuset): containers have network namespaces of their own,
  so two web containers on one host would not see each other's claims and both take the first CPUs. A container
  given its CPUs (``docker run --cpuset-cpus``, a Guaranteed pod under the kubelet's static CPU manager) is pinned.

``on`` claims regardless (the compose stack's one web container does); ``off`` never claims.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMS_ENV = "CLUSTERDX_CPU_CLAIMS"  # the claims' names start with it: two test runs side by side each set their own
ALLOWED_ENV = "CLUSTERDX_CPUS_ALLOWED"  # the CPUs the server was started with: what a spawned child goes back to
_held: list[socket.socket] = []  # the claim's bound socket, kept for the life of the process


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus`` (the affinity call sets one thread's; threads started later inherit
    their creator's)."""
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def quota_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs' worth of time the cgroup quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def in_container() -> bool:
    """Docker's, Podman's or a Kubernetes pod's (every pod's environment names its API server)."""
    return (os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
            or "KUBERNETES_SERVICE_HOST" in os.environ)


def claim(role: str, mode: str = "auto", quota: float | None = None, container: bool | None = None) -> int | None:
    """Hold this process's threads to one free CPU of those it may run on; returns the CPU, or None (and why is
    logged). ``quota``, ``container``: the cgroup's quota and whether this runs in a container (read when not
    given)."""
    if mode == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    if _held:
        return next(iter(os.sched_getaffinity(0)))
    # The server's CPUs: a process spawned by a pinned one (the ingest writer) starts on its parent's one CPU.
    allowed = sorted(_server_cpus() or os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    quota = quota_cpus() if quota is None else quota
    if mode == "auto" and quota is not None and quota < len(allowed):
        log.info("%s: not pinned to a CPU: a CPU quota of %.1f CPUs over %d visible CPUs (CLUSTERDX_PIN_CPU=on to pin)",
                 role, quota, len(allowed))
        return None
    container = in_container() if container is None else container
    if mode == "auto" and container and len(allowed) >= (os.cpu_count() or 0):
        log.info("%s: not pinned to a CPU: a container that sees all %d CPUs of its host (give it a cpuset, or "
                 "CLUSTERDX_PIN_CPU=on when it is the host's only web container)", role, len(allowed))
        return None
    os.environ.setdefault(ALLOWED_ENV, ",".join(map(str, allowed)))  # before a child is spawned: it goes back to all
    for cpu in allowed:
        sock = _bind(cpu)
        if sock is not None:
            _held.append(sock)
            _set({cpu})
            log.info("%s (pid %d): its threads pinned to CPU %d", role, os.getpid(), cpu)
            return cpu
    log.info("%s: not pinned to a CPU: every one of %s is claimed by another server process", role, allowed)
    release()
    return None


def _bind(cpu: int) -> socket.socket | None:
    """The claim on ``cpu`` (a bound socket, held while it is open), or None when another process holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0{os.environ.get(CLAIMS_ENV, 'clusterdx-cpu-')}{cpu}")
    except OSError:
        sock.close()
        return None
    return sock


def _claimed(cpu: int) -> bool:
    sock = _bind(cpu)
    if sock is None:
        return True
    sock.close()
    return False


def _server_cpus() -> set[int]:
    allowed = os.environ.get(ALLOWED_ENV)
    return {int(c) for c in allowed.split(",")} if allowed else set()


def release() -> None:
    """In a process spawned by a pinned one (it starts on its parent's one CPU): onto the CPUs the server was started
    with that no server process has claimed (the diagnosis pass off the web worker's CPU), or all of them when every
    one is claimed."""
    cpus = _server_cpus()
    if cpus and hasattr(os, "sched_setaffinity") and not _held:
        _set({c for c in cpus if not _claimed(c)} or cpus)
