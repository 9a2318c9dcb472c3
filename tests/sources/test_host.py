"""The host source: psutil on this machine, NFS from two checked-in mountstats snapshots."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.host import HostSource, NfsTotals, nfs_interval, parse_mountstats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "proc"


@pytest.fixture
def mountstats(tmp_path: Path) -> Path:
    path = tmp_path / "mountstats"
    shutil.copy(FIXTURES / "mountstats_t0", path)
    return path


def _nfs_after_two_seconds(path: Path) -> dict[str, dict[str, Any]]:
    source = HostSource(mountstats=str(path))
    assert source.start() is None
    first = Collected()
    source.collect(1000.0, first)
    assert all("rtt_ms" not in m for m in first.hosts[0]["nfs"])
    shutil.copy(FIXTURES / "mountstats_t1", path)
    second = Collected()
    source.collect(1002.0, second)
    return {m["mount"]: m for m in second.hosts[0]["nfs"]}


def test_it_parses_nfs_mounts_and_skips_other_file_systems() -> None:
    mounts = parse_mountstats((FIXTURES / "mountstats_t0").read_text())
    assert list(mounts) == ["/mnt/datasets", "/home", "/mnt/scratch space"]
    datasets = mounts["/mnt/datasets"]
    assert datasets.server == "10.0.0.5:/export/datasets"
    assert datasets.age_s == 86400
    # Sum of the ops column over every NFSv4 operation in the fixture.
    assert datasets.ops == 1 + 1278456 + 5321 + 5318 + 912 + 88213 + 20122 + 1432 + 120 + 2


def test_it_weighs_nfs_latency_by_operation_count(mountstats: Path) -> None:
    datasets = _nfs_after_two_seconds(mountstats)["/mnt/datasets"]
    # READ +1000 ops (30000 ms rtt, 32000 ms exe), GETATTR +200 (200, 220), LOOKUP +50 (100, 110), over 2 s.
    assert datasets["ops_per_s"] == 625.0
    assert datasets["rtt_ms"] == pytest.approx(30300 / 1250)
    assert datasets["exe_ms"] == pytest.approx(32330 / 1250)


def test_it_reads_nfsv3_lines_without_the_errors_column(mountstats: Path) -> None:
    scratch = _nfs_after_two_seconds(mountstats)["/mnt/scratch space"]
    assert scratch["server"] == "10.0.0.7:/scratch"
    assert scratch["ops_per_s"] == 7.5
    assert scratch["rtt_ms"] == pytest.approx(70 / 15)
    assert scratch["exe_ms"] == pytest.approx(85 / 15)


def test_an_idle_mount_has_no_latency_rather_than_zero(mountstats: Path) -> None:
    home = _nfs_after_two_seconds(mountstats)["/home"]
    assert home["ops_per_s"] == 0.0
    assert home["rtt_ms"] is None and home["exe_ms"] is None


def test_a_remount_makes_the_interval_unknown() -> None:
    before = NfsTotals("s:/e", 100, 1000, 5000, 6000)
    after = NfsTotals("s:/e", 3, 10, 20, 30)
    assert nfs_interval(before, after, 1.0) == {"ops_per_s": None, "rtt_ms": None, "exe_ms": None}


def test_it_measures_this_hosts_cpu_memory_and_loopback_traffic() -> None:
    source = HostSource(mountstats="", net_include=["lo"])
    assert source.start() is None
    out = Collected()
    source.collect(1000.0, out)
    _send_over_loopback(2_000_000)
    source.collect(1001.0, out)
    first, second = out.hosts
    assert first.get("net_rx_bytes_per_s") is None
    assert second["net_rx_bytes_per_s"] >= 2_000_000
    assert second["net_tx_bytes_per_s"] >= 2_000_000
    assert 0 <= second["cpu_pct"] <= 100
    assert 0 < second["mem_used_bytes"] < second["mem_total_bytes"]
    assert second["disk_read_bytes_per_s"] >= 0 and second["load1"] >= 0
    assert second["nfs"] is None


def test_loopback_is_left_out_by_default() -> None:
    source = HostSource(mountstats="")
    assert source._counts("eth0") and not source._counts("lo") and not source._counts("veth12ab")


def test_its_records_pass_the_wire_validator(mountstats: Path) -> None:
    source = HostSource(mountstats=str(mountstats))
    assert source.start() is None
    out = Collected()
    source.collect(1000.0, out)
    shutil.copy(FIXTURES / "mountstats_t1", mountstats)
    source.collect(1002.0, out)
    for sample in out.hosts:
        assert len(wire.validate(wire.HostSample, sample)["nfs"]) == 3


def test_an_unreadable_mountstats_gives_no_nfs(tmp_path: Path) -> None:
    source = HostSource(mountstats=str(tmp_path / "missing"))
    assert source.start() is None  # psutil is installed, so the source is still useful
    out = Collected()
    source.collect(1000.0, out)
    assert out.hosts[0]["nfs"] is None


def _send_over_loopback(nbytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(65536):
                received.append(len(chunk))

    thread = threading.Thread(target=sink)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"x" * nbytes)
    thread.join(5)
    server.close()
    assert sum(received) == nbytes
