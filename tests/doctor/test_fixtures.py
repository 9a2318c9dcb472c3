"""The doctor against real public logs (tests/fixtures/logs, sources in SOURCES.md): exact facts, field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.doctor import detect_kind, diagnose

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def _report(name: str):
    return diagnose([LOGS / name])


def test_it_reads_an_ib_plugin_completion_error_12_as_a_retry_exceeded_link_problem():
    r = _report("nccl_ib_status12_plugin.log")
    assert r.kind == "nccl"
    assert r.facts["hosts"] == ["kp-ddp-worker-0"]
    assert r.facts["failed"] is True
    assert len(r.facts["warnings"]) == 3
    assert r.facts["warnings"][0].startswith("kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB")
    assert "completion error 12" in r.verdict and "NCCL_IB_TIMEOUT" in r.verdict
    assert r.unparsed_lines == 0


def test_it_reads_the_pre_2_19_completion_format_and_names_gdr_for_error_4():
    r = _report("nccl_ib_error4_h100.log")
    assert r.facts["hosts"] == ["H100-1", "H100-2", "H100-5"]
    assert "completion error 4" in r.verdict and "nvidia-peermem" in r.verdict
    assert "3 distinct peers" in r.verdict


def test_it_sees_sockets_forced_by_nccl_ib_disable_among_mpi_noise():
    r = _report("nccl_socket_ib_disabled_mpi.log")
    f = r.facts
    assert (f["network"], f["env"], f["gdr"], f["failed"]) == ("Socket", {"NCCL_IB_DISABLE": "1"}, False, False)
    assert f["transports"] == ["Socket", "P2P/IPC"]
    assert "NCCL_IB_DISABLE=1" in r.verdict
    assert r.unparsed_lines == 3  # the three Open MPI help lines


def test_it_strips_mpi_rank_tags_and_infers_the_socket_fallback_of_2_5():
    r = _report("nccl_mpi_tagged_2.5.6.log")
    assert r.facts["nccl_version"] == "2.5.6+cuda10.2"
    assert r.facts["hosts"] == ["5873af64cf59"]
    assert "fell back to TCP sockets" in r.verdict and "No device found" in r.verdict


def test_it_reads_the_2_3_format_with_internal_network():
    r = _report("nccl_2.3.7_internal_network_ib.log")
    f = r.facts
    assert (f["nccl_version"], f["network"], f["nranks"], f["hosts"]) == ("2.3.7+cuda9.0", "IB", 8, ["learnfair0536"])
    assert r.unparsed_lines == 1  # the application's own logging line


def test_it_untangles_cloudwatch_columns_glued_to_the_host():
    r = _report("nccl_cloudwatch_columns_2.21.5.log")
    assert r.facts["hosts"] == ["ip-10-36-29-253"]
    assert r.facts["nccl_version"] == "2.21.5+cuda12.8"
    assert r.facts["env"] == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_it_names_plugin_transports_by_their_own_name():
    r = _report("nccl_aws_libfabric_ring_2.4.log")
    assert r.facts["transports"] == ["P2P/IPC", "AWS Libfabric"]
    assert r.facts["gdr"] is False
    assert r.verdict.startswith("The AWS OFI")


def test_it_calls_a_closed_socket_a_victim_not_the_cause():
    r = _report("nccl_socket_connection_closed.log")
    assert r.facts["transports"] == ["P2P/IPC", "Socket"]
    assert "another rank died" in r.verdict


@pytest.mark.parametrize(("name", "seq", "timeout", "ranks"), [
    ("torch_watchdog_timeout_2x.log", 1580, 600000, [0, 2, 3, 4]),
    ("torch_watchdog_timeout_1x.log", 469508, 1800000, [1, 2, 3, 6, 7]),
    ("torch_watchdog_progressbar.log", 96120, 1800000, [0, 7]),
])
def test_it_reads_watchdog_timeouts_of_torch_1_and_2(name, seq, timeout, ranks):
    r = _report(name)
    assert r.kind == "torch"
    assert r.facts == {"error_class": "timeout", "collective": "ALLREDUCE", "timeout_ms": timeout, "seq_num": seq,
                       "ranks": ranks, "hosts": []}
    assert "timed out" in r.verdict


def test_it_reports_desynchronised_seqnums():
    assert "different collectives" in _report("torch_watchdog_progressbar.log").verdict


def test_it_classifies_a_dist_backend_error_with_its_nccl_chain():
    r = _report("torch_nccl_internal_error_2.21.5.log")
    assert r.facts["error_class"] == "nccl_error"
    assert r.facts["ranks"] == [1] and r.facts["hosts"] == ["h100-2"]
    assert "ncclInternalError" in r.verdict


def test_it_reads_the_async_nccl_error():
    r = _report("torch_async_nccl_system_error.log")
    assert (r.kind, r.facts["error_class"], r.facts["collective"]) == ("torch", "nccl_error", "ALLREDUCE")


def test_it_reads_torchruns_failure_table():
    r = _report("torch_childfailed_table.log")
    assert r.kind == "torch"
    assert r.facts["ranks"] == [0, 1, 2, 3]
    assert r.facts["hosts"] == ["vmnuvocinpoc.internal.cloudapp.net"]
    assert "exited with code 1" in r.verdict


@pytest.mark.parametrize(("name", "xid", "pci"), [
    ("xid_79_journalctl_open_gpu_1151.log", 79, "0000:2b:00.0"),
    ("xid_79_dmesg_with_smi_table.log", 79, "0000:03:00.0"),
    ("xid_old_format_syslog.log", 3, "0000:01:00.0"),
])
def test_it_makes_one_event_per_kernel_xid_line(name, xid, pci):
    r = _report(name)
    assert r.kind == "xid"
    assert [(e["xid"], e["pci"]) for e in r.facts["events"]] == [(xid, pci)]


def test_xid_79_says_drain_the_node():
    assert "Drain the node" in _report("xid_79_journalctl_open_gpu_1151.log").verdict


def test_it_reads_ibstat_with_spaces_or_tabs():
    down = _report("ib_ibstat_polling.log")
    assert down.facts["ports"] == [{"device": "mlx5_10", "port": 1, "state": "Down", "phys_state": "Polling",
                                    "rate_gbps": 10.0, "link_layer": "InfiniBand", "error_counters": {}}]
    assert "Polling" in down.verdict and "cable" in down.verdict
    up = _report("ib_ibstat_tabs_partial.log")
    assert up.facts["ports"][0]["state"] == "Active" and up.facts["ports"][0]["rate_gbps"] == 200.0


def test_it_reads_an_nvidia_smi_fragment_that_starts_mid_gpu():
    r = _report("smi_q_old_schema_fragment.log")
    assert r.kind == "nvidia-smi"
    assert r.facts["gpus"][0]["retired_pages"] == {"Single Bit ECC": 0, "Double Bit ECC": 0,
                                                   "Pending Page Blacklist": "No"}


def test_it_keeps_the_gpu_of_a_truncated_xml_paste():
    gpu = _report("smi_qx_truncated_2019.log").facts["gpus"][0]
    assert (gpu["bus_id"], gpu["name"]) == ("00000000:01:00.0", "GeForce GTX 1080")


def test_several_rank_logs_merge_into_one_job():
    r = diagnose([LOGS / "nccl_ib_error4_h100.log", LOGS / "nccl_ib_status12_plugin.log"])
    assert r.facts["hosts"] == ["H100-1", "H100-2", "H100-5", "kp-ddp-worker-0"]
    assert len(r.facts["warnings"]) == 6


def test_detect_kind_on_every_fixture_matches_the_file_name():
    for path in sorted(LOGS.glob("*.log")):
        expected = {"smi": "nvidia-smi"}.get(path.name.split("_")[0], path.name.split("_")[0])
        assert diagnose([path]).kind == expected, path.name
    assert detect_kind("hello\nworld\n") == "unknown"
