"""A full disk under the agent's spool: every batch it could not store is counted, the count (and the drops those
batches carried) rides in the next batch that is stored, and the server turns it into a warning event of the node.

The disk is really full: the spool runs in a subprocess on a 256 KiB tmpfs (a private mount namespace, so no root
is needed) filled to the last block; where mounting is not allowed, the process's file size limit (RLIMIT_FSIZE)
makes the writes fail instead.
"""

from __future__ import annotations

import base64
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs the real spool; argv: directory, "tmpfs" | "rlimit". Prints what it saw as JSON.
SCRIPT = r"""
import base64, json, os, resource, signal, sys, time
from collectors.agent.spool import Spool

where, mode = sys.argv[1], sys.argv[2]
spool = Spool(os.path.join(where, "spool.sqlite3"))


def body(i):
    # Random text does not compress: each batch takes its size on disk.
    now = time.time()
    return {"v": 1, "agent_id": "node-x", "host": "node-x", "sent_at": now,
            "events": [{"ts": now, "kind": "kmsg", "message": os.urandom(1500).hex()}]}


spool.put(body(0))
if mode == "tmpfs":  # fill the file system to the last block
    fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT)
    for size in (65536, 4096, 512, 1):
        try:
            while True:
                os.write(fd, b"\0" * size)
        except OSError:
            pass
    os.close(fd)
else:  # no mount: the file size limit stops the spool's files from growing
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = max(os.path.getsize(os.path.join(where, "spool.sqlite3" + s)) for s in ("", "-wal"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
failed, errors = 0, set()
for i in range(1, 40):
    try:
        spool.put(body(i), {"source_error": 2} if i == 1 else None)
    except Exception as exc:
        failed += 1
        errors.add(type(exc).__name__)
if mode == "tmpfs":
    os.remove(os.path.join(where, "filler"))
else:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
spool.put(body(99))
stored = []
while (item := spool.oldest()) is not None:
    stored.append(base64.b64encode(item.body).decode())
    spool.delete(item.seq)
print(json.dumps({"failed": failed, "errors": sorted(errors), "stored": stored, "depth": spool.depth}))
"""


def run_spool(where: Path, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-c", SCRIPT, str(where), mode]
    if mode == "tmpfs":
        shell = f"mount -t tmpfs -o size=256k tmpfs {where} && exec \"$@\""
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell, "sh", *cmd]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0 and mode == "tmpfs" and "mount" in proc.stderr + proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def batches(seen: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(gzip.decompress(base64.b64decode(b))) for b in seen["stored"]]


def total(stored: list[dict[str, Any]], reason: str) -> int:
    return sum((b.get("dropped") or {}).get(reason, 0) for b in stored)


@pytest.mark.parametrize("mode", ["tmpfs", "rlimit"])
def test_every_batch_a_full_disk_refused_is_reported_in_the_next_one(tmp_path: Path, mode: str) -> None:
    if mode == "tmpfs" and shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a private tmpfs")
    seen = run_spool(tmp_path, mode)
    stored = batches(seen)
    assert seen["failed"] >= 5, seen["errors"]  # the disk really was full for a while
    assert len(stored) + seen["failed"] == 41 and seen["depth"] == 0
    assert total(stored, "disk_full") == seen["failed"], "each batch the spool could not keep is counted once"
    assert total(stored, "source_error") == 2, "the drops a refused batch carried are reported, not lost"
    assert stored[-1]["dropped"]["disk_full"] >= 1  # the batch stored after the disk was freed carries the gap
    assert [b["seq"] for b in stored] == sorted(b["seq"] for b in stored)


@pytest.mark.django_db
def test_the_server_shows_the_gap_on_the_node(tmp_path: Path, client: Any) -> None:
    from dashboard.telemetry import tokens
    from dashboard.telemetry.models import Cluster, Event

    seen = run_spool(tmp_path, "rlimit")
    _, token = tokens.create_token(Cluster.objects.create(name="prod-a"), "agents")
    for raw in seen["stored"]:
        r = client.generic("POST", "/api/v1/ingest", base64.b64decode(raw), content_type="application/json",
                           HTTP_CONTENT_ENCODING="gzip", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert r.status_code == 200, r.content
    gaps = list(Event.objects.filter(kind="agent").values_list("severity", "node__hostname", "message"))
    n = seen["failed"]
    assert gaps == [("warning", "node-x", f"agent node-x dropped {n} batches: disk full")]
