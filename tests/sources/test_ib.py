"""The InfiniBand / RoCE source against two checked-in snapshots of /sys/class/infiniband."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from clusterdx import wire
from collectors.agent.source import Collected
from collectors.sources.ib import IbSource, counter_delta, parse_rate_gbps, parse_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sys"


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURES / "class_infiniband_t0", root)
    return root


def _advance(root: Path) -> None:
    """Second snapshot: the t1 tree written over the t0 one, as the kernel would update the files in place."""
    shutil.copytree(FIXTURES / "class_infiniband_t1", root, dirs_exist_ok=True)


def _two_samples(root: Path, **options: Any) -> dict[str, dict[str, Any]]:
    source = IbSource(root=str(root), **options)
    assert source.start() is None
    first = Collected()
    source.collect(1000.0, first)
    _advance(root)
    second = Collected()
    source.collect(1000.5, second)
    source.close()
    return {p["device"]: p for p in second.ports}


def test_it_parses_rate_and_state() -> None:
    assert parse_rate_gbps("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate_gbps("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_rate_gbps("invalid") is None
    assert parse_rate_gbps(None) is None
    assert parse_state("4: ACTIVE") == "ACTIVE"
    assert parse_state("5: LinkUp") == "LinkUp"
    assert parse_state("") is None


def test_it_reports_no_interval_on_first_sight(sysfs: Path) -> None:
    source = IbSource(root=str(sysfs))
    assert source.start() is None
    out = Collected()
    source.collect(1000.0, out)
    source.close()
    assert [(p["device"], p["port"]) for p in out.ports] == [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2", 1), ("mlx5_3", 1)]
    first = out.ports[0]
    assert "counters" not in first and "xmit_bytes_per_s" not in first
    assert first["state"] == "ACTIVE" and first["phys_state"] == "LinkUp" and first["rate_gbps"] == 400.0
    assert first["link_layer"] == "InfiniBand"


def test_it_sends_deltas_and_byte_rates(sysfs: Path) -> None:
    ports = _two_samples(sysfs)
    healthy = ports["mlx5_0"]
    assert healthy["interval_s"] == 0.5
    assert healthy["counters"]["port_xmit_data"] == 7_500_000_000
    assert healthy["counters"]["port_xmit_wait"] == 1234
    assert healthy["counters"]["symbol_error"] == 0
    assert healthy["counters"]["hw.rx_write_requests"] == 1000
    # 7.5e9 four-byte words in half a second.
    assert healthy["xmit_bytes_per_s"] == 60e9
    assert healthy["rcv_bytes_per_s"] == 56e9
    assert "unavailable" not in healthy


def test_it_reports_saturated_counters_as_unavailable_not_zero(sysfs: Path) -> None:
    bad = _two_samples(sysfs)["mlx5_1"]
    counters = bad["counters"]
    for stuck in ("symbol_error", "local_link_integrity_errors", "port_rcv_data"):
        assert stuck not in counters
        assert "saturated" in bad["unavailable"][stuck]
    assert bad["unavailable"]["symbol_error"].startswith("saturated at 65535 (16-bit)")
    assert bad["unavailable"]["local_link_integrity_errors"].startswith("saturated at 15 (4-bit)")
    assert bad["rcv_bytes_per_s"] is None
    assert counters["link_downed"] == 1
    assert counters["link_error_recovery"] == 2
    assert counters["port_rcv_errors"] == 4
    assert counters["port_rcv_remote_physical_errors"] == 0
    assert counters["hw.local_ack_timeout_err"] == 3


def test_it_counts_a_cleared_counter_from_zero(sysfs: Path) -> None:
    bad = _two_samples(sysfs)["mlx5_1"]
    assert bad["counters"]["port_xmit_data"] == 1000
    assert bad["counters"]["port_xmit_packets"] == 4
    assert bad["xmit_bytes_per_s"] == 8000.0


def test_it_reads_roce_hw_counters_but_not_settings(sysfs: Path) -> None:
    roce = _two_samples(sysfs)["mlx5_2"]
    assert roce["link_layer"] == "Ethernet"
    assert roce["rate_gbps"] == 100.0
    assert roce["counters"]["hw.out_of_buffer"] == 17
    assert roce["counters"]["hw.rp_cnp_handled"] == 55
    assert roce["counters"]["port_xmit_discards"] == 6
    assert "hw.lifespan" not in roce["counters"]


def test_it_reports_a_down_port(sysfs: Path) -> None:
    down = _two_samples(sysfs)["mlx5_3"]
    assert (down["state"], down["phys_state"]) == ("DOWN", "Disabled")
    assert not any(k.startswith("hw.") for k in down["counters"])


def test_its_records_pass_the_wire_validator(sysfs: Path) -> None:
    for port in _two_samples(sysfs).values():
        assert wire.validate(wire.PortSample, port)["device"] == port["device"]


def test_it_filters_devices_and_counters(sysfs: Path) -> None:
    ports = _two_samples(sysfs, devices=["mlx5_0"], counters=["symbol_error"], hw_counters=False)
    assert list(ports) == ["mlx5_0"]
    assert ports["mlx5_0"]["counters"] == {"symbol_error": 0}
    assert ports["mlx5_0"]["xmit_bytes_per_s"] is None


def test_it_says_why_it_is_off(tmp_path: Path) -> None:
    assert "does not exist" in (IbSource(root=str(tmp_path / "none")).start() or "")
    assert "no InfiniBand/RoCE ports" in (IbSource(root=str(tmp_path)).start() or "")


def test_it_survives_a_port_that_vanishes(sysfs: Path) -> None:
    source = IbSource(root=str(sysfs), rescan_s=0)
    assert source.start() is None
    source.collect(1000.0, Collected())
    shutil.rmtree(sysfs / "mlx5_2")
    out = Collected()
    source.collect(1001.0, out)
    source.close()
    assert [p["device"] for p in out.ports] == ["mlx5_0", "mlx5_1", "mlx5_3"]


@pytest.mark.parametrize("max_open_files", [0, 20, 1024])
def test_held_files_and_files_opened_each_time_read_the_same(sysfs: Path, max_open_files: int) -> None:
    ports = _two_samples(sysfs, max_open_files=max_open_files)
    assert ports["mlx5_0"]["counters"]["port_xmit_data"] == 7_500_000_000
    assert ports["mlx5_2"]["counters"]["hw.out_of_buffer"] == 17
    assert ports["mlx5_1"]["unavailable"]["symbol_error"].startswith("saturated")


def test_a_reloaded_driver_is_read_again_after_a_rescan(sysfs: Path) -> None:
    """New sysfs nodes under the same names (driver reload): held descriptors would read the old ones forever."""
    source = IbSource(root=str(sysfs), rescan_s=0)
    assert source.start() is None
    source.collect(1000.0, Collected())
    counter = sysfs / "mlx5_0" / "ports" / "1" / "counters" / "link_downed"
    counter.unlink()
    counter.write_text("3\n")  # a new inode
    out = Collected()
    source.collect(1001.0, out)
    source.close()
    assert out.ports[0]["counters"]["link_downed"] == 3


def test_counter_delta_rules() -> None:
    assert counter_delta("symbol_error", 10, 12) == (2, None)
    assert counter_delta("symbol_error", 10, 3) == (3, None)
    assert counter_delta("symbol_error", None, 3) == (None, None)
    assert counter_delta("link_downed", 254, 255)[0] is None
    # A 64-bit extended data counter far above 2**32 is not saturated.
    assert counter_delta("port_xmit_data", 2**40, 2**40 + 5) == (5, None)
    assert counter_delta("hw.out_of_buffer", 2**32 - 1, 2**32 - 1) == (0, None)
    assert counter_delta("symbol_error", 1, None) == (None, "not readable")
