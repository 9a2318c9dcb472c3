"""The doctor on messier real logs (issue 15): fixtures in tests/fixtures/logs (sources in SOURCES.md) and what the
doctor must say about each. Inputs built inside a test say so."""

from __future__ import annotations

from pathlib import Path

from clusterdx import wire
from collectors.doctor import diagnose
from collectors.doctor.nccl import NcclStreamParser

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def _report(name: str):
    return diagnose([LOGS / name])


def test_transports_come_from_net_ib_using_when_there_are_no_channel_lines():
    r = _report("nccl_roce_net_ib_using_no_channels_2.19.3.log")
    f = r.facts
    assert (f["transports"], f["network"], f["hosts"]) == (["IB"], "IB", ["dgxh100-3", "dgxh100-4"])
    assert f["net_devices"] == ["mlx5_10:1/RoCE", "mlx5_11:1/RoCE"]
    assert f["interfaces"] == ["enp220s0np0"]
    # RoCE and no NCCL_IB_GID_INDEX among the variables NCCL printed: the audit's RoCE rule.
    assert "NCCL_IB_GID_INDEX is unset on RoCE" in r.verdict and "show_gids" in r.verdict


def test_the_grouped_device_list_of_the_ib_plugins_and_a_plugin_network():
    r = _report("nccl_ibext_grouped_devices_2.2x.log")
    f = r.facts
    assert f["transports"] == ["IBext_v8"] and f["interfaces"] == ["bond0.526"]
    assert f["net_devices"] == ["mlx5_2:1/RoCE", "mlx5_3:1/RoCE", "mlx5_0:1/RoCE", "mlx5_1:1/RoCE"]
    assert f["nranks"] == 3 and f["failed"] is False


def test_the_old_bootstrap_list_of_every_interface_and_a_roce_mlx4():
    r = _report("nccl_bootstrap_list_roce_mlx4_2.4.log")
    f = r.facts
    assert f["transports"] == ["IB"] and f["net_devices"] == ["mlx4_0:1/RoCE"]
    assert f["interfaces"][:3] == ["enp7s0", "virbr0", "vethee19468"] and len(f["interfaces"]) == 16
    assert r.unparsed_lines == 6  # the shell prompt and the application's own lines


def test_a_socket_ifname_prefix_that_matches_is_not_blamed_and_roce_wants_a_gid_index():
    r = _report("nccl_roce_ifname_prefix_dgx_a100.log")
    assert r.facts["env"]["NCCL_SOCKET_IFNAME"] == "en" and r.facts["interfaces"] == ["enp225s0f1"]
    causes = [r.finding.cause, *(o.cause for o in r.others)]
    assert not any("NCCL_SOCKET_IFNAME" in c for c in causes)
    assert any(c.startswith("NCCL_IB_GID_INDEX is unset on RoCE") for c in causes)
    assert "ncclInternalError" in r.verdict  # the "net.cc:55 -> 3" chain outranks the tuning advice


def test_warn_lines_separated_by_blank_lines_are_each_read():
    r = _report("nccl_warn_blank_separated_2.21.5.log")
    assert r.facts["warnings"] == [
        "c76d92cccb6e:72:457 [1] enqueue.cc:58 NCCL WARN Cuda failure 'named symbol not found'",
        "c76d92cccb6e:72:459 [3] enqueue.cc:47 NCCL WARN Cuda failure 'named symbol not found'",
        "c76d92cccb6e:72:459 [3] enqueue.cc:58 NCCL WARN Cuda failure 'named symbol not found'",
    ]
    assert r.verdict.startswith("A CUDA error surfaced inside NCCL") and r.unparsed_lines == 0


def test_warn_lines_without_a_host_prefix():
    # Built here: the same WARN texts as the public fixtures, with the host:pid:tid a log shipper dropped.
    text = ("NCCL WARN NET/IB : Got completion from peer 10.0.0.2<49392> with error 12, opcode 0, len 0, vendor err 129 "
            "(Recv)\n\n[1,3]<stderr>:NCCL WARN Connection closed by remote peer\nThe docs say NCCL WARN lines matter\n"
            "2024-05-01 10:00:01.123 transport/net_ib.cc:1234 NCCL WARN NET/IB : peer 10.0.0.3 failed\n")
    r = diagnose(text)
    assert r.kind == "nccl" and r.facts["hosts"] == []
    assert r.facts["warnings"] == [
        "NCCL WARN NET/IB : Got completion from peer 10.0.0.2<49392> with error 12, opcode 0, len 0, vendor err 129 "
        "(Recv)", "NCCL WARN Connection closed by remote peer", "NCCL WARN NET/IB : peer 10.0.0.3 failed"]
    assert "completion error 12" in r.verdict
    assert r.unparsed_lines == 1  # prose that quotes "NCCL WARN" is not a record


def test_a_watchdog_timeout_inside_a_terminate_message_after_stack_frames():
    r = _report("torch_watchdog_terminate_frames_2.x.log")
    f = r.facts
    assert (r.kind, f["error_class"], f["collective"], f["seq_num"], f["timeout_ms"], f["ranks"]) == \
        ("torch", "timeout", "_REDUCE_SCATTER_BASE", 199, 600000, [1])


def test_a_python_wrapped_communicator_abort_and_its_markdown_copy():
    r = _report("torch_python_wrapped_communicator_aborted.log")
    assert (r.facts["collective"], r.facts["seq_num"], r.facts["timeout_ms"], r.facts["ranks"]) == \
        ("ALLREDUCE", 2511984, 1800000, [0, 1, 2])
    one = _report("torch_markdown_bold_aborted_one_line.log")
    assert (one.kind, one.facts["collective"], one.facts["seq_num"], one.facts["ranks"]) == ("torch", "BROADCAST", 10, [2])


def test_a_multi_line_fallen_off_the_bus_message_between_other_driver_lines():
    r = _report("xid_79_dmesg_multiline_fallen_off.log")
    assert r.kind == "xid"
    assert r.verdict.startswith("GPU 0000:b3:00.0 fell off the bus") and "Drain the node" in r.verdict


def test_an_xid_among_unrelated_kernel_messages_and_one_with_a_redacted_pci_id():
    r = _report("xid_79_interleaved_kernel_lines.log")
    assert [(e["xid"], e["pci"]) for e in r.facts["events"]] == [(79, "0000:44:00.0")]
    assert r.unparsed_lines == 3
    # Built here: the same line with the PCI id redacted as people paste it.
    red = diagnose("kernel: NVRM: Xid (PCI:0000:xx:00): 79, pid=1234, GPU has fallen off the bus\n")
    assert red.kind == "xid" and [(e["xid"], e["pci"]) for e in red.facts["events"]] == [(79, "0000:xx:00")]
    assert red.verdict.startswith("Xid 79 on GPU 0000:xx:00")


def test_hw_power_brake_slowdown_is_read_and_named_when_active():
    r = _report("smi_q_throttle_hw_power_brake.log")
    assert r.kind == "nvidia-smi" and r.facts["gpus"][0]["throttle_reasons_active"] == ["Idle"]
    assert r.verdict.startswith("Nothing in this text")
    # Built here from the fixture: the brake asserted (nvidia-smi also raises its parent, HW Slowdown).
    text = (LOGS / "smi_q_throttle_hw_power_brake.log").read_text()
    text = text.replace("HW Power Brake Slowdown : Not Active", "HW Power Brake Slowdown : Active")
    text = text.replace("HW Slowdown                 : Not Active", "HW Slowdown                 : Active")
    braked = diagnose(text)
    assert braked.facts["gpus"][0]["throttle_reasons_active"] == ["Idle", "HW Slowdown", "HW Power Brake Slowdown"]
    assert "HW Power Brake Slowdown is active" in braked.verdict and "power supplies" in braked.verdict
    assert not any("clocks held down by" in o.cause for o in braked.others), "the brake is not a thermal problem"


def test_ibqueryerrors_port_all_lines_with_readable_copies():
    r = _report("ib_ibqueryerrors_xmitwait.log")
    (port,) = r.facts["ports"]
    assert (port["device"], port["port"]) == ("0x1070fd0300370ea2", 0)
    assert port["error_counters"] == {"LinkDownedCounter": 25, "PortRcvErrors": 26, "PortXmitDiscards": 2846,
                                      "PortXmitWait": 14681376621}
    assert "physical-layer errors (LinkDownedCounter=25)" in r.verdict


def test_saturated_32_bit_sysfs_counters_are_said_to_be_saturated():
    # Built here: a sysfs counter dump as `grep . /sys/class/infiniband/*/ports/*/counters/*` prints it.
    base = "/sys/class/infiniband/mlx5_0/ports/1/counters/"
    text = "\n".join([f"{base}port_rcv_errors:4294967295", f"{base}symbol_error:0", f"{base}port_xmit_discards:12",
                      "/sys/class/infiniband/mlx5_0/ports/1/state:4: ACTIVE"])
    r = diagnose(text)
    (port,) = r.facts["ports"]
    assert port["saturated"] == ["port_rcv_errors"] and port["error_counters"]["port_rcv_errors"] == 4294967295
    causes = [r.finding.cause, *(o.cause for o in r.others)]
    assert any("port_rcv_errors saturated" in c for c in causes)


def test_the_audit_reads_the_environment_nccl_printed():
    # Built here: the "set by environment" lines NCCL prints, with settings the rule table flags.
    head = "node1:1:2 [0] NCCL INFO "
    text = "\n".join(head + line for line in (
        "NCCL_IB_HCA set by environment to =mlx5_4", "NCCL_IB_TIMEOUT set by environment to 20",
        "NCCL_P2P_DISABLE set by environment to 1", "NET/IB : No device found.",
        "NET/Socket : Using [0]eth0:10.0.0.1<0>", "Using network Socket"))
    r = diagnose(text)
    causes = [r.finding.cause, *(o.cause for o in r.others)]
    assert r.verdict.startswith("NCCL fell back to TCP sockets")
    for expected in ("NCCL_IB_HCA==mlx5_4 and NCCL found no IB device", "NCCL_P2P_DISABLE=1"):
        assert any(c.startswith(expected) for c in causes), expected
    # Sockets only: the IB timeout does not matter here.
    assert not any("NCCL_IB_TIMEOUT" in c for c in causes)


def test_the_agents_parser_sends_the_hcas_and_interfaces_nccl_listed():
    p = NcclStreamParser()
    lines = (LOGS / "nccl_roce_net_ib_using_no_channels_2.19.3.log").read_text().splitlines()
    lines.append("node9:1:2 [0] NCCL INFO NET/Socket : Using [0]ens1f0:10.0.0.9<0> [1]ens1f1:10.0.1.9<0>")
    events = [e for line in lines for e in p.feed(line)]
    got = [(e["data"]["host"], e["data"]["fact"], e["data"].get("devices") or e["data"].get("interfaces"),
            e["data"].get("links"), e["data"].get("oob")) for e in events if e["data"]["fact"] in ("net_devices", "interfaces")]
    assert got == [("dgxh100-4", "net_devices", "mlx5_10:1 mlx5_11:1", "RoCE", "enp220s0np0"),
                   ("dgxh100-3", "net_devices", "mlx5_10:1 mlx5_11:1", "RoCE", "enp220s0np0"),
                   ("node9", "interfaces", "ens1f0 ens1f1", None, None)]
    for e in events:
        wire.validate(wire.Event, dict(e, ts=1.0))
