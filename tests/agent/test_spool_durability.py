"""The agent's spool against crashes and poison (issue 12, items 1 and 5), with real spools and the real ingest.

* The sequence counter is on disk (fsynced) before a numbered batch can be sent: an OS crash cannot hand the same
  seq to a new batch. Checked at the system-call level with a small LD_PRELOAD shim that logs every fsync.
* Should a counter roll back anyway (a spool restored from a snapshot), the server answers the reused seq with 409
  ``seq_reused`` and the agent renumbers the batch instead of deleting it.
* A batch the server can never store is dropped, counted and reported; it never blocks the batches behind it.
* A hostile or broken hook datagram is dropped and counted on the agent; it never reaches a batch.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import REPO

from collectors.agent.delivery import Backoff, Poster, Sender
from collectors.agent.hooks import HookSource
from collectors.agent.source import Collected
from collectors.agent.spool import Spool

# -- the counter is durable -----------------------------------------------------------------------------------------

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void note(int fd) {
    char link[64], path[4096];
    const char *log = getenv("SYNC_LOG");
    if (!log) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 2);
    if (n < 0) return;
    path[n++] = '\n';
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (out >= 0) { (void)!write(out, path, (size_t)n); close(out); }
}
int fsync(int fd) { note(fd); return ((int (*)(int))dlsym(RTLD_NEXT, "fsync"))(fd); }
int fdatasync(int fd) { note(fd); return ((int (*)(int))dlsym(RTLD_NEXT, "fdatasync"))(fd); }
"""

WRITER = """
import sys, time
from collectors.agent.spool import Spool
log = open(sys.argv[2], "a", buffering=1)
spool = Spool(sys.argv[1])
log.write("--put\\n")
seqs = [spool.put({"v": 1, "agent_id": "n1", "host": "n1", "sent_at": time.time()}) for _ in range(5)]
log.write("--delete\\n")
for seq in seqs:
    spool.delete(seq)
log.write("--end\\n")
spool.close()
"""


def _shim(tmp_path: Path) -> Path:
    src, lib = tmp_path / "syncshim.c", tmp_path / "syncshim.so"
    src.write_text(SHIM)
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True,
                       capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no C compiler (cc) to build the fsync-logging shim")
    return lib


def test_every_numbered_batch_is_on_disk_before_it_can_be_sent(tmp_path: Path) -> None:
    log = tmp_path / "syncs.log"
    spool = tmp_path / "spool.sqlite3"
    env = {**os.environ, "LD_PRELOAD": str(_shim(tmp_path)), "SYNC_LOG": str(log)}
    subprocess.run([sys.executable, "-c", WRITER, str(spool), str(log)], cwd=REPO, env=env, check=True, timeout=60)
    phases: dict[str, list[str]] = {}
    current = "open"
    for line in log.read_text().splitlines():
        if line.startswith("--"):
            current = line[2:]
        else:
            phases.setdefault(current, []).append(line)
    wal = str(spool) + "-wal"
    # One fsync of the write-ahead log per numbered batch: an OS crash cannot roll the counter back past a seq
    # that a batch already carried to the server.
    assert phases.get("put", []).count(wal) >= 5, phases
    # Deleting an acknowledged batch is not synced (a replay after a crash is a duplicate the server recognises),
    # so draining a day-long backlog costs no fsync per batch.
    assert phases.get("delete", []).count(wal) == 0, phases


# -- a reused seq is renumbered, not deleted; a refused batch is dropped, not retried -------------------------------

@pytest.fixture
def token(live_server: Any) -> Iterator[str]:
    from dashboard.ingest.writer import clear_caches
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster

    clear_caches()
    _, secret = tokens.create_token(Cluster.objects.create(name="dur"), "agents")
    yield secret
    clear_caches()


def _body(util: float, **extra: Any) -> dict[str, Any]:
    now = time.time()
    return {"v": 1, "agent_id": "n1", "host": "n1", "sent_at": now,
            "gpus": [{"ts": now, "index": 0, "util_gpu_pct": util}], **extra}


def _drain(spool: Spool, sender: Sender, limit: int = 6) -> None:
    for _ in range(limit):
        item = spool.oldest()
        if item is None:
            return
        sender.deliver(item)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_counter_costs_no_batch(live_server: Any, token: str, tmp_path: Path) -> None:
    from dashboard.storage import frames as fr
    from dashboard.telemetry.models import AgentBatch
    from tests.server import framed

    path = tmp_path / "spool.sqlite3"
    spool = Spool(path)
    poster = Poster(live_server.url, lambda: token, timeout=5)
    sender = Sender(spool, poster, Backoff(0.05, 0.3))
    try:
        first = spool.put(_body(10.0))
        _drain(spool, sender)
        # What the disk holds now; an OS crash that loses every later write returns the spool to this state.
        snapshot = {suffix: Path(f"{path}{suffix}").read_bytes() for suffix in ("", "-wal")}
        lost = spool.put(_body(20.0))
        _drain(spool, sender)
        spool.close()
        for suffix, data in snapshot.items():
            Path(f"{path}{suffix}").write_bytes(data)
        Path(f"{path}-shm").unlink(missing_ok=True)
        spool = sender.spool = Spool(path)
        reused = spool.put(_body(30.0))
        assert reused == lost  # the emulated crash really handed the seq out again
        _drain(spool, sender)
    finally:
        poster.close()
        spool.close()
    stored = sorted(framed.stored(fr.GPUS)["util_gpu_pct"].tolist())
    assert stored == [10.0, 20.0, 30.0], "the batch numbered with a reused seq was deleted instead of delivered"
    seqs = sorted(AgentBatch.objects.values_list("seq", flat=True))
    assert seqs[:2] == [first, lost] and seqs[2] > lost
    assert sender.stats.renumbered == 1 and sender.stats.rejected == 0


@pytest.mark.django_db(transaction=True)
def test_a_batch_the_server_can_never_store_does_not_block_the_spool(live_server: Any, token: str,
                                                                     tmp_path: Path) -> None:
    from dashboard.telemetry.models import AgentBatch

    spool = Spool(tmp_path / "spool.sqlite3")
    poster = Poster(live_server.url, lambda: token, timeout=5)
    sender = Sender(spool, poster, Backoff(0.05, 0.3))
    try:
        poison = spool.put(_body(10.0, events=[{"ts": time.time(), "kind": "nccl", "message": "bad \ud800 byte"}]))
        _drain(spool, sender, limit=3)
        assert spool.depth == 0, "the poison batch is still at the head of the spool, retried forever"
        good = spool.put(_body(20.0))
        _drain(spool, sender)
    finally:
        poster.close()
        spool.close()
    assert list(AgentBatch.objects.values_list("seq", "dropped")) == [(good, {"server_rejected": 1})]
    assert poison != good and sender.stats.rejected == 1
    assert sender.stats.by_status.get(400) == 1 and not sender.stats.by_status.get(500)


@pytest.mark.django_db(transaction=True)
def test_a_clock_a_day_ahead_costs_its_batches_and_one_log_line(live_server: Any, token: str, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from dashboard.telemetry.models import AgentBatch

    spool = Spool(tmp_path / "spool.sqlite3")
    poster = Poster(live_server.url, lambda: token, timeout=5)
    sender = Sender(spool, poster, Backoff(0.05, 0.3))
    try:
        with caplog.at_level("ERROR", logger="clusterdx.agent.delivery"):
            for lag in (0.0, 1.5, 3.0):  # each refusal names another number of seconds
                spool.put({**_body(10.0), "sent_at": time.time() + 86_400 + lag})
                _drain(spool, sender)
        spool.put(_body(20.0))  # the clock is fixed
        _drain(spool, sender)
    finally:
        poster.close()
        spool.close()
    assert sender.stats.by_status.get(400) == 3 and spool.depth == 0
    assert list(AgentBatch.objects.values_list("dropped", flat=True)) == [{"server_rejected": 3}]
    refusals = [r.getMessage() for r in caplog.records if "server rejected batch" in r.getMessage()]
    assert len(refusals) == 1 and "clock_skew: sent_at: 86400 s ahead of the server's clock" in refusals[0]


# -- hook datagrams that would poison a batch are dropped on arrival ------------------------------------------------

def _gram(**lists: Any) -> bytes:
    return json.dumps({"v": 1, "host": "n1", "pid": 7, **lists}).encode()


def test_a_hostile_hook_datagram_is_counted_and_never_forwarded() -> None:
    hooks = HookSource(addr="127.0.0.1:0")
    now = time.time()
    step = {"run": "r1", "rank": 0, "step": 1, "ts": now, "step_time_s": 0.5}
    hooks.accept(_gram(steps=[{**step, "metrics": {"loss\ud800": 1.0}}]))
    hooks.accept(_gram(runs=[{"run": "r1", "rank": 0, "world_size": 2, "ts": now, "env": {"A": "\udfff"}}]))
    hooks.accept(_gram(steps=[{**step, "ts": now + 86_400}]))  # a forged or broken clock, a day ahead
    hooks.accept(_gram(pid=2**31))
    hooks.accept(_gram(steps=[{**step, "step": 2}]))
    out = Collected()
    hooks.collect(now, out)
    assert [s["step"] for s in out.steps] == [2] and out.runs == []
    assert out.dropped == {"hook_bad_datagram": 4}


def test_spooled_bodies_survive_a_copy_round_trip(tmp_path: Path) -> None:
    """The emulated crash above copies the spool files while a connection is open: that must be a valid spool."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path)
    seq = spool.put(_body(1.0))
    copy = tmp_path / "copy"
    copy.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(f"{path}{suffix}", copy / f"spool.sqlite3{suffix}")
    spool.close()
    again = Spool(copy / "spool.sqlite3")
    item = again.oldest()
    assert item is not None and item.seq == seq
    assert json.loads(gzip.decompress(item.body))["gpus"][0]["util_gpu_pct"] == 1.0
    again.close()
