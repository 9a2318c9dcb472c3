"""Messy text (built here, synthetic): hard wraps, ANSI, CRLF, truncated lines; nvidia-smi new schema; IB dumps."""

from __future__ import annotations

import io

from collectors.doctor import diagnose

NCCL = [
    "gpu-a:100:200 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 14.",
    "gpu-a:100:200 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA",
    "gpu-b:300:400 [1] NCCL INFO Channel 00/0 : 9[1] -> 10[2] via P2P/CUMEM/read",
    "gpu-b:300:400 [1] NCCL INFO Channel 00/0 : 9[1] -> 10[2] via SHM/direct/direct",
    "gpu-b:300:400 [1] NCCL INFO comm 0x55 rank 9 nranks 16 cudaDev 1 busId 1b000 - Init COMPLETE",
]


def test_it_survives_ansi_crlf_and_a_truncated_first_line():
    text = "L INFO Channel 00 trunc\r\n" + "\r\n".join(f"\x1b[32m{line}\x1b[0m" for line in NCCL) + "\r\n"
    r = diagnose(text)
    assert r.facts["transports"] == ["IB", "P2P/CUMEM", "SHM"]
    assert r.facts["gdr"] is True and r.facts["nranks"] == 16
    assert r.facts["env"] == {"NCCL_IB_TIMEOUT": "14"}
    assert r.unparsed_lines == 1


def test_it_rejoins_lines_hard_wrapped_at_the_terminal_width():
    width = 60
    wrapped: list[str] = []
    for line in NCCL * 2:
        wrapped += [line[i:i + width] for i in range(0, len(line), width)]
    r = diagnose("\n".join(wrapped) + "\n")
    assert r.facts["transports"] == ["IB", "P2P/CUMEM", "SHM"]
    assert r.facts["nranks"] == 16
    assert r.unparsed_lines == 0


def test_prefixes_from_pdsh_timestamps_and_consoles_are_skipped():
    lines = [f"gpu-a: {NCCL[1]}", f"[2024-05-01 10:00:00] {NCCL[2]}", f" | 12:00:01 | {NCCL[3]}"]
    r = diagnose("\n".join(lines))
    assert r.facts["hosts"] == ["gpu-a", "gpu-b"]
    assert r.unparsed_lines == 0


def test_duplicated_tracebacks_count_each_rank_once():
    err = ("[rank3]:[E1206 18:44:12.715 ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation "
           "timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=5, NumelOut=1, Timeout(ms)=600000) "
           "ran for 600061 milliseconds before timing out.")
    r = diagnose("\n".join([err, err, err]) + "\n" + "\n".join(NCCL))
    assert r.kind == "torch"
    assert r.facts["ranks"] == [3] and r.facts["collective"] == "_REDUCE_SCATTER_BASE"
    assert r.facts["hosts"] == ["gpu-a", "gpu-b"]
    assert "ranks that did not report" in r.verdict  # nranks 16 from the NCCL lines


def test_store_timeout_is_classified_with_its_timeout():
    text = ("torch.distributed.DistStoreError: Timed out after 1801 seconds waiting for clients. 1/2 clients "
            "joined.\n")
    r = diagnose(text)
    assert (r.kind, r.facts["error_class"], r.facts["timeout_ms"]) == ("torch", "store_timeout", 1801000)


def test_heartbeat_monitor_is_its_own_class():
    text = ("[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Heartbeat monitor timed out! Process will be "
            "terminated after dumping debug info. workMetaList_.size()=1\n")
    assert diagnose(text).facts["error_class"] == "heartbeat_monitor_timeout"


SMI_NEW = """==============NVSMI LOG==============

Driver Version                            : 550.54.15

GPU 00000000:18:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
    Ecc Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 3
            DRAM Uncorrectable            : 1
        Aggregate
            SRAM Correctable              : 0
            DRAM Correctable              : 12
            DRAM Uncorrectable            : 1
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 1
        Pending                           : Yes
        Remapping Failure Occurred        : No
    Clocks Event Reasons
        Idle                              : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Active
"""


def test_nvidia_smi_new_schema_with_a_pending_remap_says_reset_the_gpu():
    r = diagnose(SMI_NEW)
    gpu = r.facts["gpus"][0]
    assert r.kind == "nvidia-smi"
    assert gpu["bus_id"] == "00000000:18:00.0" and gpu["ecc_mode"] == "Enabled"
    assert gpu["ecc"]["volatile"]["DRAM Uncorrectable"] == 1
    assert gpu["remapped_rows"]["Pending"] == "Yes"
    assert gpu["throttle_reasons_active"] == ["SW Power Cap", "HW Thermal Slowdown"]
    assert "row remap pending" in r.verdict and "reset" in r.verdict


SMI_XML = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
  <gpu id="00000000:3B:00.0">
    <product_name>NVIDIA A100-SXM4-80GB</product_name>
    <ecc_mode><current_ecc>Enabled</current_ecc><pending_ecc>Enabled</pending_ecc></ecc_mode>
    <ecc_errors><volatile><dram_uncorrectable>0</dram_uncorrectable></volatile>
      <aggregate><dram_uncorrectable>2</dram_uncorrectable></aggregate></ecc_errors>
    <remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>2</remapped_row_unc>
      <remapped_row_pending>No</remapped_row_pending><remapped_row_failure>Yes</remapped_row_failure></remapped_rows>
    <clocks_event_reasons><clocks_event_reason_gpu_idle>Active</clocks_event_reason_gpu_idle></clocks_event_reasons>
  </gpu>
</nvidia_smi_log>
"""


def test_nvidia_smi_xml_gives_the_same_facts_and_a_failed_remap_is_an_rma():
    r = diagnose(io.BytesIO(SMI_XML.encode()))
    gpu = r.facts["gpus"][0]
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB" and gpu["ecc_mode"] == "Enabled"
    assert gpu["ecc"]["aggregate"] == {"dram_uncorrectable": 2}
    assert gpu["throttle_reasons_active"] == ["Idle"]
    assert "RMA" in r.verdict


def test_sysfs_perfquery_and_ibqueryerrors_dumps():
    text = "\n".join([
        "/sys/class/infiniband/mlx5_0/ports/1/state:4: ACTIVE",
        "/sys/class/infiniband/mlx5_0/ports/1/phys_state:5: LinkUp",
        "/sys/class/infiniband/mlx5_0/ports/1/rate:200 Gb/sec (4X HDR)",
        "/sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error:17",
        "/sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_errors:0",
        "/sys/class/infiniband/mlx5_1/ports/1/rate:100 Gb/sec (4X EDR)",
        "/sys/class/infiniband/mlx5_1/ports/1/state:4: ACTIVE",
    ])
    r = diagnose(text, kind="ib")
    ports = {p["device"]: p for p in r.facts["ports"]}
    assert ports["mlx5_0"]["error_counters"] == {"symbol_error": 17}
    assert (ports["mlx5_0"]["state"], ports["mlx5_0"]["phys_state"]) == ("Active", "LinkUp")
    assert "physical-layer errors" in r.verdict
    perf = diagnose("# Port counters: Lid 5 port 1 (CapMask: 0x5A00)\nPortSelect:......................1\n"
                    "SymbolErrorCounter:..............0\nLinkDownedCounter:...............3\n", kind="ib")
    assert perf.facts["ports"][0]["error_counters"] == {"LinkDownedCounter": 3}
    qerr = diagnose('Errors for "node1 mlx5_0"\n   GUID 0x0002c9030005f5c1 port 1: [LinkDownedCounter == 3] '
                    "[PortRcvErrors == 12]\n", kind="ib")
    assert qerr.facts["ports"][0]["error_counters"] == {"LinkDownedCounter": 3, "PortRcvErrors": 12}
    assert detect_kind_of(text) == "ib"


def detect_kind_of(text: str) -> str:
    from collectors.doctor import detect_kind

    return detect_kind(text)


def test_json_shape_is_exactly_the_issues():
    d = diagnose("\n".join(NCCL)).to_dict()
    assert list(d) == ["kind", "facts", "verdict", "unparsed_lines"]
    assert list(d["facts"]) == ["nccl_version", "hosts", "nranks", "transports", "network", "net_devices",
                                "interfaces", "gdr", "env", "warnings", "failed"]
