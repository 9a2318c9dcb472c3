"""Each web worker on a CPU of its own (dashboard/affinity.py): real processes, real affinity calls, read back from
/proc. Nothing here runs in the test process itself, which must stay free to run on every CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from dashboard import affinity
from tests.conftest import free_port, port_open

ROOT = Path(__file__).resolve().parents[2]


def _free_cpus() -> list[int]:
    return [c for c in sorted(os.sched_getaffinity(0)) if not affinity._claimed(c)]


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


@pytest.fixture(autouse=True)
def own_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims of this test's own (its processes inherit the environment): no server elsewhere on the machine, such as
    the other test pass's, takes a CPU from under it, nor it from them."""
    monkeypatch.setenv(affinity.CLAIMS_ENV, f"cdxtest-affinity-{uuid.uuid4().hex[:8]}-")


def _cpulist(text: str) -> frozenset[int]:
    """The kernel's CPU list ("0-3,6") as a set."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def _cpus_of_threads(pid: int) -> set[frozenset[int]]:
    """Each thread's allowed CPUs, as the kernel reports them."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        out.add(_cpulist(next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))))
    return out


def _claimer(mode: str = "auto", quota: float | None = None, container: bool = False,
             child: str = "release") -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != affinity.ALLOWED_ENV}
    argv = [sys.executable, str(Path(__file__).with_name("affinity_claimer.py")), mode, str(quota).lower(),
            str(int(container)), child]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _claimed_by(proc: subprocess.Popen[str]) -> tuple[int | None, list[int]]:
    """The CPU ``proc`` claimed (None: not pinned), and the CPUs its spawned child runs on."""
    assert proc.stdout is not None
    cpu, child = proc.stdout.readline().split()
    return (None if cpu == "None" else int(cpu)), [int(c) for c in child.split(",")]


@needs_two
def test_each_process_claims_a_cpu_of_its_own_until_none_is_left() -> None:
    free = _free_cpus()
    procs = [_claimer() for _ in range(len(free) + 1)]
    try:
        claims = [_claimed_by(proc)[0] for proc in procs]
        assert sorted(c for c in claims if c is not None) == free, claims
        assert claims.count(None) == 1, "once every CPU is claimed a further process is not pinned"
        for proc, cpu in zip(procs, claims, strict=True):
            # every thread: one running before the claim, the main one, one started after it
            assert _cpus_of_threads(proc.pid) == ({frozenset({cpu})} if cpu is not None else
                                                  {frozenset(os.sched_getaffinity(0))}), cpu
    finally:
        for proc in procs:
            proc.communicate("", timeout=30)
    assert _free_cpus() == free, "a claim ends with its process"


@needs_two
def test_a_spawned_child_runs_off_its_pinned_parents_cpu() -> None:
    proc = _claimer()
    try:
        cpu, child = _claimed_by(proc)
        assert cpu is not None and child and cpu not in child, (cpu, child)
        assert set(child) <= set(_free_cpus()) | {cpu}
    finally:
        proc.communicate("", timeout=30)


@needs_two
def test_a_spawned_child_claims_a_cpu_of_its_own_beside_its_parents() -> None:
    """As the ingest writer's process does: it starts on its parent's one CPU, and claims another of the server's."""
    proc = _claimer(child="claim")
    try:
        cpu, child = _claimed_by(proc)
        assert cpu is not None and child != [-1] and child != [cpu], (cpu, child)
    finally:
        proc.communicate("", timeout=30)


@needs_two
@pytest.mark.parametrize("where", ["quota", "container"])
def test_where_claims_could_collide_unseen_auto_does_not_pin(where: str) -> None:
    """A container limited by a CPU quota, or one that sees its host's every CPU: its claims would not see another
    container's, so ``auto`` leaves it unpinned; ``on`` pins it anyway, ``off`` never."""
    every = frozenset(os.sched_getaffinity(0))
    if where == "container" and len(every) < (os.cpu_count() or 0):
        pytest.skip("this process has a cpuset of its own: a container here would be pinned")
    quota = len(every) - 0.5 if where == "quota" else None
    for mode, pinned in (("auto", False), ("on", True), ("off", False)):
        proc = _claimer(mode, quota, container=where == "container")
        try:
            cpu, _ = _claimed_by(proc)
            assert (cpu is not None) is pinned, mode
            assert _cpus_of_threads(proc.pid) == ({frozenset({cpu})} if pinned else {every}), mode
        finally:
            proc.communicate("", timeout=30)


def test_the_quota_is_read_from_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert affinity.quota_cpus(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert affinity.quota_cpus(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert affinity.quota_cpus(tmp_path / "v1") == 2.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert affinity.quota_cpus(tmp_path / "v1") is None
    assert affinity.quota_cpus(tmp_path / "nothing") is None


@needs_two
@pytest.mark.slow
def test_clusterdx_server_pins_its_worker_and_can_be_told_not_to() -> None:
    """The real `clusterdx server` on the embedded default: every thread of its worker on one CPU; with
    CLUSTERDX_PIN_CPU=off, on all of them. (``on``: this machine is a container that sees all its host's CPUs, where
    ``auto`` does not pin; the claims' choice of CPU is the tests' above.)"""
    free = _free_cpus()
    for mode in ("on", "off"):
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="cdx-pin-") as data:
            env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", affinity.ALLOWED_ENV)}
            env.update(CLUSTERDX_DATA_DIR=data, CLUSTERDX_PIN_CPU=mode, DJANGO_SETTINGS_MODULE="dashboard.settings")
            proc = subprocess.Popen([sys.executable, "-m", "clusterdx", "server", "--port", str(port)], cwd=ROOT,
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 90
                while not port_open("127.0.0.1", port):
                    assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                    time.sleep(0.2)
                cpus = _cpus_of_threads(proc.pid)
                if mode == "on":
                    assert len(cpus) == 1 and len(next(iter(cpus))) == 1 and next(iter(cpus)) <= set(free), cpus
                else:
                    assert cpus == {frozenset(os.sched_getaffinity(0))}, cpus
            finally:
                proc.terminate()
                proc.wait(30)
