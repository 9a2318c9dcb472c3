"""The host source's interface list: read from a stand-in /sys/class/net (tests/fixtures/sys/class_net), addresses
from this machine's getifaddrs, sent when it changes or every few minutes, never every second."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.host import HostSource, if_addresses, read_interfaces

SYS_NET = Path(__file__).resolve().parents[1] / "fixtures" / "sys" / "class_net"


@pytest.fixture
def sys_net(tmp_path: Path) -> Path:
    root = tmp_path / "class_net"
    shutil.copytree(SYS_NET, root)
    return root


def test_it_reads_state_kind_mtu_and_speed_physical_interfaces_first() -> None:
    got = read_interfaces(str(SYS_NET), {"ens1f0": ["10.0.0.7/24"], "lo": ["127.0.0.1/8"]})
    assert got is not None
    assert [(i["name"], i["state"], i["kind"], i["virtual"]) for i in got] == [
        ("ens1f0", "up", "ether", False), ("ens1f1", "down", "ether", False), ("ib0", "up", "infiniband", False),
        ("bond0", "lowerlayerdown", "ether", True), ("docker0", "down", "ether", True),
        ("lo", "unknown", "loopback", True)]
    by_name = {i["name"]: i for i in got}
    assert by_name["ens1f0"]["speed_mbps"] == 100_000 and by_name["ens1f0"]["mtu"] == 9000
    assert by_name["ens1f1"]["speed_mbps"] is None, "the kernel's -1 (no carrier) is unknown, not a speed"
    assert by_name["lo"]["speed_mbps"] is None and by_name["lo"]["addresses"] == ["127.0.0.1/8"]
    assert by_name["ib0"]["addresses"] == []
    for record in got:
        wire.validate(wire.NetInterface, record)


def test_names_the_wire_cannot_carry_are_left_out_with_a_warning(sys_net: Path, caplog: pytest.LogCaptureFixture) -> None:
    (sys_net / "a-name-far-too-long-for-linux").mkdir()
    (sys_net / "tab\there").mkdir()
    got = read_interfaces(str(sys_net))
    assert got is not None and "ens1f0" in [i["name"] for i in got] and len(got) == 6
    assert "a-name-far-too-long" in caplog.text and "tab" in caplog.text


def test_no_sysfs_means_no_list_rather_than_an_empty_one(tmp_path: Path) -> None:
    assert read_interfaces(str(tmp_path / "missing")) is None


def test_addresses_come_from_getifaddrs_with_their_prefix() -> None:
    addrs = if_addresses(psutil)
    assert "127.0.0.1/8" in addrs["lo"]
    assert all("%" not in a for got in addrs.values() for a in got)


def test_it_sends_the_list_at_start_on_a_change_and_every_few_minutes_only(sys_net: Path) -> None:
    source = HostSource(mountstats="", sys_net=str(sys_net), interfaces_check_s=10, interfaces_every_s=300)
    assert source.start() is None
    out = Collected()
    for second in range(0, 60):
        source.collect(1000.0 + second, out)
    sent = [i for i, s in enumerate(out.hosts) if "interfaces" in s]
    assert sent == [0], "unchanged: once at start, not every second"
    (sys_net / "ens1f0" / "operstate").write_text("down\n")
    source.collect(1065.0, out)  # checked at most every 10 s: the change goes out at the next check
    assert out.hosts[-1]["interfaces"][0] == {**out.hosts[0]["interfaces"][0], "state": "down"}
    source.collect(1075.0, out)
    source.collect(1364.0, out)  # checked: unchanged and sent 299 s ago
    assert "interfaces" not in out.hosts[-2] and "interfaces" not in out.hosts[-1]
    source.collect(1374.0, out)  # the next check, past 300 s: sent again though nothing changed
    assert out.hosts[-1]["interfaces"] == out.hosts[-4]["interfaces"]
    for sample in out.hosts:
        wire.validate(wire.HostSample, sample)


def test_an_empty_sys_net_turns_the_list_off() -> None:
    source = HostSource(mountstats="", sys_net="")
    assert source.start() is None
    out = Collected()
    source.collect(1000.0, out)
    assert "interfaces" not in out.hosts[0]
