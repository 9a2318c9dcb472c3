"""The GPU source end to end: the real agent process, the real pynvml bindings, a stand-in libnvidia-ml.so.1 playing
a scripted 8-GPU node, and a real HTTP receiver validating every batch against the wire format."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_support import Receiver, free_port, start_agent, wait_for

from clusterdx import wire

SCENARIO = """\
gpus 8
0   3 ecc_sbe_volatile 10 20        # corrected errors climbing on GPU 3
0   3 ecc_sbe_aggregate 100 20
0.6 5 throttle 72                   # hw_slowdown | hw_thermal_slowdown from 0.6 s on
0.6 5 sm_clock 1275
0.8 2 xid 79                        # GPU 2 falls off the bus
0   6 remap_pending 1               # a row remap waits for a GPU reset
0   6 remap_uncorrectable 1
0   7 error nvmlDeviceGetPcieReplayCounter 3   # NVML_ERROR_NOT_SUPPORTED
0   1 error nvmlDeviceGetRemappedRows 3        # a pre-Ampere GPU: page retirement instead of row remapping
0   1 retired_sbe 2
0   4 nvlinks 0                     # a PCIe card without NVLink
0   0 nvlinks_down 2
0   0 nvlink_crc_flit 5             # NVLink totals through field values...
0   0 nvlink_crc_data 2
0   5 error nvmlDeviceGetFieldValues 13        # ...or, where NVML lacks them, summed over the links
0   5 nvlink_replay 4
"""


@pytest.fixture(scope="module")
def run(standin: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("gpu-run")
    receiver = Receiver()
    port = free_port()
    agent = start_agent(tmp, receiver.url, lib_dir=standin, scenario=SCENARIO, args=("--metrics-port", str(port)))
    try:
        # Past the Xid at 0.8 s and the throttle at 0.6 s, with some batches either side.
        wait_for(lambda: len(receiver.accepted) >= 9, what="nine batches")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        code = agent.stop()
        receiver.stop()
    return {"batches": receiver.accepted, "log": agent.log(), "metrics": metrics, "exit": code,
            "duplicates": receiver.duplicates}


def gpu(batch: dict[str, Any], index: int) -> dict[str, Any]:
    return next(g for g in batch["gpus"] if g["index"] == index)


def test_it_sends_valid_numbered_batches_of_eight_gpus(run: dict[str, Any]) -> None:
    batches = run["batches"]
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert not run["duplicates"]
    assert all(b["agent_id"] == "test-node" and len(b["gpus"]) == 8 for b in batches)
    assert run["exit"] == 0


def test_it_says_which_sources_are_on_and_why_others_are_off(run: dict[str, Any]) -> None:
    log = run["log"]
    assert re.search(r"gpu\s+on\s+8 GPU\(s\): NVIDIA H100 80GB HBM3; driver 550.54.15-standin", log)
    assert re.search(r"hooks\s+on\s+udp 127.0.0.1:\d+", log)
    assert re.search(r"ib\s+off\s+disabled in the config", log)


def test_it_reports_every_gpu_field_or_says_why_not(run: dict[str, Any]) -> None:
    names = [n for n in wire.field_names(wire.GpuSample) if n != "unavailable"]
    for batch in run["batches"]:
        for sample in batch["gpus"]:
            missing = [n for n in names if sample[n] is None and n not in (sample["unavailable"] or {})]
            assert not missing, (sample["index"], missing)


def test_it_sees_ecc_errors_rise(run: dict[str, Any]) -> None:
    counts = [gpu(b, 3)["ecc_sbe_volatile"] for b in run["batches"]]
    assert counts == sorted(counts) and counts[-1] > counts[0] >= 10
    assert gpu(run["batches"][-1], 3)["ecc_sbe_aggregate"] >= 100
    assert {gpu(b, 0)["ecc_sbe_volatile"] for b in run["batches"]} == {0}


def test_it_decodes_throttle_reasons(run: dict[str, Any]) -> None:
    first, last = gpu(run["batches"][0], 5), gpu(run["batches"][-1], 5)
    assert first["throttle_reasons"] == [] and first["sm_clock_mhz"] == 1980
    assert last["throttle_reasons"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert last["sm_clock_mhz"] == 1275 and last["sm_clock_max_mhz"] == 1980


def test_it_forwards_the_xid_event_once_with_its_meaning(run: dict[str, Any]) -> None:
    xids = [e for b in run["batches"] for e in b["events"] if e["kind"] == "xid"]
    assert len(xids) == 1
    (xid,) = xids
    assert (xid["code"], xid["gpu_index"], xid["pci_bus_id"], xid["severity"]) == (79, 2, "0000:3a:00.0", "critical")
    assert "fallen off the bus" in xid["data"]["meaning"] and xid["data"]["action"]


def test_it_reports_a_pending_row_remap(run: dict[str, Any]) -> None:
    sample = gpu(run["batches"][-1], 6)
    assert (sample["remap_pending"], sample["remap_uncorrectable"], sample["remap_failure"]) == (True, 1, False)
    assert sample["unavailable"]["retired_pages_pending"] == "superseded by row remapping on this GPU"


def test_it_uses_page_retirement_where_row_remapping_is_unsupported(run: dict[str, Any]) -> None:
    sample = gpu(run["batches"][-1], 1)
    assert (sample["retired_pages_sbe"], sample["retired_pages_dbe"], sample["retired_pages_pending"]) == (2, 0, False)
    assert sample["remap_pending"] is None and sample["unavailable"]["remap_pending"] == "not supported"


def test_an_unsupported_field_is_null_with_its_reason(run: dict[str, Any]) -> None:
    sample = gpu(run["batches"][-1], 7)
    assert sample["pcie_replay_total"] is None
    assert sample["unavailable"]["pcie_replay_total"] == "not supported"
    assert gpu(run["batches"][-1], 6)["pcie_replay_total"] == 0  # zero where it is a real zero


def test_it_reads_nvlink_and_pcie_links(run: dict[str, Any]) -> None:
    sample = gpu(run["batches"][-1], 0)
    assert (sample["nvlink_links_up"], sample["nvlink_links_total"]) == (16, 18)
    assert (sample["nvlink_crc_errors_total"], sample["nvlink_replay_errors_total"]) == (7, 0)
    per_link = gpu(run["batches"][-1], 5)
    assert (per_link["nvlink_crc_errors_total"], per_link["nvlink_replay_errors_total"]) == (0, 4)
    assert (sample["pcie_gen"], sample["pcie_gen_max"], sample["pcie_width"], sample["pcie_width_max"]) == \
        (5, 5, 16, 16)
    pcie_card = gpu(run["batches"][-1], 4)
    assert pcie_card["nvlink_links_total"] is None
    assert pcie_card["unavailable"]["nvlink_links_total"] == "not supported"


def test_metrics_use_dcgm_exporter_names_and_labels(run: dict[str, Any]) -> None:
    text = run["metrics"]
    labels = ('Hostname="test-node",UUID="GPU-5ad1e000-0000-4000-8000-000000000002",device="nvidia2",gpu="2",'
              'modelName="NVIDIA H100 80GB HBM3",pci_bus_id="0000:3a:00.0"')
    assert f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 87.0" in text
    assert f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} 79.0" in text
    assert f"DCGM_FI_DEV_FB_USED{{{labels}}} 58368.0" in text  # MiB, as dcgm-exporter reports it
    assert re.search(r'DCGM_FI_DEV_ROW_REMAP_PENDING\{[^}]*gpu="6"[^}]*\} 1.0', text)
    assert re.search(r'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL\{[^}]*gpu="3"[^}]*\} [1-9]', text)
    assert not re.search(r'DCGM_FI_DEV_PCIE_REPLAY_COUNTER\{[^}]*gpu="7"', text)  # unsupported: absent, not 0
    assert re.search(r"^clusterdx_agent_batches_sent_total [1-9]", text, re.M)
    assert "clusterdx_agent_spool_batches " in text


def test_an_old_driver_falls_back_and_logs_a_missing_function_once(standin_old: Path, tmp_path: Path) -> None:
    receiver = Receiver()
    agent = start_agent(tmp_path, receiver.url, lib_dir=standin_old, scenario="gpus 2\n0.0 1 throttle 4\n")
    try:
        wait_for(lambda: len(receiver.accepted) >= 4, what="four batches")
    finally:
        agent.stop()
        receiver.stop()
    sample = gpu(receiver.accepted[-1], 1)
    assert sample["throttle_reasons"] == ["sw_power_cap"]  # through the older ThrottleReasons call
    assert sample["mem_used_bytes"] == 61203283968  # through nvmlDeviceGetMemoryInfo v1
    assert sample["retired_pages_sbe"] == 0  # no row remapping in this driver: page retirement
    assert sample["unavailable"]["remap_pending"] == "nvmlDeviceGetRemappedRows not in this driver's NVML"
    log = agent.log()
    assert log.count("NVML has no nvmlDeviceGetRemappedRows") == 1
    assert log.count("NVML has no nvmlDeviceGetCurrentClocksEventReasons") == 1
