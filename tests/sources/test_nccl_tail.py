"""The NCCL log tailer: new files, rotation, truncation, partial lines, junk, bounds; real parser, real files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.nccl_tail import NcclLogSource

HEAD = "gpu-node-07:12345:12345 [0]"
VERSION = f"{HEAD} NCCL INFO NCCL version 2.21.5+cuda12.4\n"
SOCKET = f"{HEAD} NCCL INFO Using network Socket\n"
CHATTER = f"{HEAD} NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>\n"
RESET = (f"{HEAD} misc/socket.cc:49 NCCL WARN socketProgressOpt: Call to recv from 10.0.0.8<51234> failed : "
         "Connection reset by peer\n")
IB_ERR = (f"{HEAD} transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer 10.0.0.8<51234> with "
          "status=12 opcode=1 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.7 remoteGid ::ffff:10.0.0.8\n")


class Tailer:
    """A started source over ``dir/nccl.*.log`` and a clock; ``step()`` is one agent interval."""

    def __init__(self, directory: Path, **options: Any) -> None:
        options.setdefault("rescan_s", 0)
        self.source = NcclLogSource(glob=str(directory / "nccl.*.log"), **options)
        assert self.source.start() is None
        self.now = 1_764_464_000.0
        self.dropped: dict[str, int] = {}

    def step(self) -> list[dict[str, Any]]:
        self.now += 1
        out = Collected()
        self.source.collect(self.now, out)
        for key, value in out.dropped.items():
            self.dropped[key] = self.dropped.get(key, 0) + value
        for event in out.events:
            assert event["ts"] == self.now
            wire.validate(wire.Event, event)
        return out.events


def _append(path: Path, text: str | bytes) -> None:
    with path.open("ab") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def _facts(events: list[dict[str, Any]]) -> list[str]:
    return [e["data"]["fact"] for e in events]


def test_it_reads_new_files_from_their_start_and_old_files_from_now(tmp_path: Path) -> None:
    old = tmp_path / "nccl.node.1.log"
    old.write_text(VERSION + RESET)
    tail = Tailer(tmp_path)
    assert tail.step() == []  # what was there before the agent started is not re-sent
    _append(old, SOCKET)
    new = tmp_path / "nccl.node.2.log"
    new.write_text(VERSION + CHATTER + RESET)
    events = tail.step()
    assert sorted((Path(e["data"]["file"]).name, e["data"]["fact"]) for e in events) == [
        ("nccl.node.1.log", "network"), ("nccl.node.2.log", "version"), ("nccl.node.2.log", "warn")]
    assert all(e["data"]["host"] == "gpu-node-07" for e in events)


def test_from_start_reads_existing_files(tmp_path: Path) -> None:
    (tmp_path / "nccl.node.1.log").write_text(VERSION + RESET)
    assert _facts(Tailer(tmp_path, from_start=True).step()) == ["version", "warn"]


def test_a_partial_line_waits_for_its_newline(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text("")
    tail = Tailer(tmp_path)
    _append(log, RESET[:40])
    assert tail.step() == []
    _append(log, RESET[40:-1])
    assert tail.step() == []
    _append(log, "\n")
    assert _facts(tail.step()) == ["warn"]


def test_it_follows_a_rotation_without_losing_the_old_files_tail(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text(VERSION)
    tail = Tailer(tmp_path, from_start=True)
    assert _facts(tail.step()) == ["version"]
    with log.open("a") as writer:  # the process still holds its descriptor while logrotate renames the file
        writer.write(RESET)
        os.rename(log, tmp_path / "nccl.node.1.log-rotated")
        writer.write(IB_ERR)
    log.write_text(VERSION + SOCKET)  # the new file, with a new inode
    events = tail.step()
    # The rest of the old file first, then the new one through a fresh parser (so its version shows again).
    assert _facts(events) == ["warn", "ib_error", "version", "network"]


def test_a_rotation_into_the_glob_is_not_read_twice(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text(VERSION)
    tail = Tailer(tmp_path, from_start=True)
    assert _facts(tail.step()) == ["version"]
    os.rename(log, tmp_path / "nccl.node.1.old.log")  # also matches nccl.*.log
    assert tail.step() == []
    _append(tmp_path / "nccl.node.1.old.log", RESET)
    assert _facts(tail.step()) == ["warn"]


def test_it_rereads_a_truncated_file(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text(CHATTER * 20 + RESET)
    tail = Tailer(tmp_path, from_start=True)
    assert _facts(tail.step()) == ["warn"]
    with log.open("r+") as f:  # copytruncate
        f.truncate(0)
    _append(log, IB_ERR)
    assert _facts(tail.step()) == ["ib_error"]


def test_binary_junk_does_not_break_the_records(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text("")
    tail = Tailer(tmp_path)
    junk = bytes(range(256)) * 64 + b"\xff\xfe\x00\x00NCCL WARN \x00\xc3(\n" + b"x" * 200_000
    _append(log, junk + b"\n" + RESET.replace("reset", "re\x00set").encode() + b"\xe2\x82")
    events = tail.step()  # every event was validated by the wire format (no NULs, bounded lengths)
    assert _facts(events)[-1] == "warn"
    assert "Connection reset by peer" in events[-1]["message"]


def test_a_deleted_file_is_forgotten(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text("")
    tail = Tailer(tmp_path)
    _append(log, RESET)
    log.unlink()
    assert _facts(tail.step()) == ["warn"]  # read to its end through the open descriptor
    assert tail.source._tails == {}
    log.write_text(VERSION + RESET + SOCKET)  # a new file, likely on the deleted one's inode: read from its start
    assert _facts(tail.step()) == ["version", "warn", "network"]


def test_reads_are_bounded_per_interval(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text("")
    tail = Tailer(tmp_path, max_bytes=10_000)
    _append(log, (CHATTER * 100 + RESET) * 5)  # about 50 kB
    counts = [len(tail.step()) for _ in range(8)]
    assert counts[0] < 5 and sum(counts) == 5


def test_events_beyond_the_bound_are_counted_as_dropped(tmp_path: Path) -> None:
    log = tmp_path / "nccl.node.1.log"
    log.write_text("")
    tail = Tailer(tmp_path, max_events=10)
    _append(log, RESET * 25)
    assert len(tail.step()) == 10
    assert tail.dropped == {"nccl_events": 15}


def test_it_keeps_up_with_a_thousand_lines_a_second(tmp_path: Path) -> None:
    """Ten seconds of a busy log (1,000 lines/s over four files) read in ten intervals, every WARN kept."""
    files = [tmp_path / f"nccl.node.{i}.log" for i in range(4)]
    for f in files:
        f.write_text("")
    tail = Tailer(tmp_path)
    warns = 0
    for _ in range(10):
        for f in files:
            _append(f, CHATTER * 249 + RESET)
        warns += sum(1 for e in tail.step() if e["data"]["fact"] == "warn")
    assert warns == 40
    tail.source.close()
