"""The kernel log source against real-format lines: dmesg -T, raw /dev/kmsg records and journalctl short-unix."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.kmsg import KmsgSource, line_time

XID_79_KMSG = "4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2718, name=python, GPU has fallen off the bus."
XID_48_DMESG_T = ("[Mon Nov 24 10:00:00 2025] NVRM: Xid (PCI:0000:86:00): 48, pid=31337, name=pt_main_thread, "
                  "Ch 00000010, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
                  "at partition 6, subpartition 0.")
XID_13_JOURNAL = ("1764464000.123456 gpu-node-07 kernel: NVRM: Xid (PCI:0000:1b:00): 13, pid=4242, name=python3, "
                  "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address")
OFF_BUS_DMESG = ("[ 8123.456789] NVRM: GPU at PCI:0000:af:00: GPU-2f1c9a44-5c0e-7d4f-9b51-0e3d1a6c8f21 has fallen "
                 "off the bus.")
NOISE = [
    "[ 8123.400000] mlx5_core 0000:5e:00.0: mlx5_cmd_out_err:838: ACCESS_REG(0x805) op_mod(0x1) failed",
    "1764464001.000001 gpu-node-07 kernel: nvidia-nvlink: Unregistered Nvlink Core, major device number 510",
    "6,1235,5679000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
]


def _start_on(path: Path, **options: object) -> KmsgSource:
    source = KmsgSource(path=str(path), **options)
    assert source.start() is None
    return source


def test_it_turns_xid_lines_of_every_format_into_events(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:01:00): 31, an old line before the agent started\n")
    source = _start_on(log)
    with log.open("a") as f:
        f.write("\n".join([NOISE[0], XID_79_KMSG, XID_48_DMESG_T, NOISE[1], XID_13_JOURNAL, OFF_BUS_DMESG, NOISE[2]]))
        f.write("\n")
    out = Collected()
    now = time.time()
    source.collect(now, out)
    source.close()
    assert [(e["code"], e["pci_bus_id"]) for e in out.events] == [
        (79, "0000:3b:00.0"), (48, "0000:86:00.0"), (13, "0000:1b:00.0"), (79, "0000:af:00.0")]
    by_code = {e["code"]: e for e in out.events}
    assert by_code[13]["ts"] == 1764464000.123456  # journalctl short-unix carries the time
    assert by_code[48]["ts"] == time.mktime(time.strptime("Mon Nov 24 10:00:00 2025", "%a %b %d %H:%M:%S %Y"))
    assert out.events[0]["ts"] == now  # a raw record read from a file: its boot-relative time is meaningless here
    assert by_code[48]["severity"] in ("error", "critical")
    assert by_code[48]["data"]["pid"] == "31337"
    for event in out.events:
        assert wire.validate(wire.Event, event)["kind"] == "xid"


def test_it_keeps_a_partial_line_until_it_is_complete(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.touch()
    source = _start_on(log)
    half = len(XID_13_JOURNAL) // 2
    with log.open("a") as f:
        f.write(XID_13_JOURNAL[:half])
    out = Collected()
    source.collect(time.time(), out)
    assert out.events == []
    with log.open("a") as f:
        f.write(XID_13_JOURNAL[half:] + "\n")
    source.collect(time.time(), out)
    source.close()
    assert [e["code"] for e in out.events] == [13]


def test_it_reads_old_lines_when_asked(tmp_path: Path) -> None:
    log = tmp_path / "dmesg.txt"
    log.write_text(XID_48_DMESG_T + "\n" + OFF_BUS_DMESG + "\n")
    source = _start_on(log, from_start=True)
    out = Collected()
    source.collect(time.time(), out)
    source.close()
    assert [e["code"] for e in out.events] == [48, 79]


def test_it_reads_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    source = _start_on(fifo)
    out = Collected()
    source.collect(time.time(), out)  # no writer yet: nothing, and no error
    writer = os.open(fifo, os.O_WRONLY)
    os.write(writer, (XID_79_KMSG + "\n").encode())
    os.close(writer)
    source.collect(time.time(), out)
    writer = os.open(fifo, os.O_WRONLY)  # a second writer after the first went away
    os.write(writer, (XID_13_JOURNAL + "\n").encode())
    os.close(writer)
    source.collect(time.time(), out)
    source.close()
    assert [e["code"] for e in out.events] == [79, 13]


def test_it_bounds_the_lines_read_per_interval(tmp_path: Path) -> None:
    log = tmp_path / "storm.log"
    log.write_text("")
    source = _start_on(log, max_lines=100)
    with log.open("a") as f:
        f.write((XID_79_KMSG + "\n") * 300)
    out = Collected()
    source.collect(time.time(), out)
    assert len(out.events) == 100
    source.collect(time.time(), out)
    source.collect(time.time(), out)
    assert len(out.events) == 300
    source.collect(time.time(), out)
    source.close()
    assert len(out.events) == 300


def test_it_reads_dev_kmsg_from_now_on(tmp_path: Path) -> None:
    """The real device: a harmless marker line written to the kernel log comes back through the reader."""
    if not (os.access("/dev/kmsg", os.R_OK) and os.access("/dev/kmsg", os.W_OK)):
        pytest.skip("needs read and write access to /dev/kmsg (root)")
    source = KmsgSource(journal_cmd=[])
    assert source.start() is None
    assert source.origin == "/dev/kmsg"
    marker = f"clusterdx-kmsg-test {uuid.uuid4()}"
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    os.write(fd, f"<6>{marker}\n".encode())
    os.close(fd)
    assert source._reader is not None
    lines = source._reader.read(1000)
    source.close()
    mine = [(text, ts) for text, ts in lines if text == marker]
    assert len(mine) == 1
    assert mine[0][1] == pytest.approx(time.time(), abs=5)  # boot-relative time mapped to Unix time


def test_it_falls_back_to_the_journal(tmp_path: Path) -> None:
    """A stand-in for journalctl (none runs here) that prints short-unix lines and keeps running, as -f does."""
    script = f"print({XID_13_JOURNAL!r}, flush=True); import time; time.sleep(30)"
    source = KmsgSource(device=str(tmp_path / "no-kmsg"), journal_cmd=[sys.executable, "-c", script])
    assert source.start() is None
    assert source.origin.startswith(sys.executable)
    out = Collected()
    deadline = time.monotonic() + 10
    while not out.events and time.monotonic() < deadline:
        source.collect(time.time(), out)
        time.sleep(0.05)
    source.close()
    assert [(e["code"], e["ts"]) for e in out.events] == [(13, 1764464000.123456)]


def test_it_says_why_it_is_off(tmp_path: Path) -> None:
    assert "cannot read" in (KmsgSource(path=str(tmp_path / "missing")).start() or "")
    no_device = str(tmp_path / "no-kmsg")
    reason = KmsgSource(device=no_device, journal_cmd=["no-such-journalctl"]).start() or ""
    assert reason == f"cannot read {no_device}: No such file or directory; and no-such-journalctl is not installed"
    failing = [sys.executable, "-c", "import sys; sys.exit('No journal files were found.')"]
    reason = KmsgSource(device=no_device, journal_cmd=failing).start() or ""
    assert reason.endswith("exited with 1: No journal files were found.")


def test_line_time() -> None:
    assert line_time("1764464000.5 host kernel: x") == 1764464000.5
    assert line_time("[ 12.345] x") is None
    assert line_time("[Xyz Nov 99 10:00:00 2025] x") is None
