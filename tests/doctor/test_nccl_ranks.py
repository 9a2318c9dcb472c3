"""Each transport fact names the rank that uses it: the agent's parser over real NCCL logs (one process per file, and
a launcher's combined output) and over the init-then-connect order of NCCL 2.19+."""

from __future__ import annotations

from pathlib import Path

from clusterdx import wire
from collectors.doctor.nccl import NcclStreamParser

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def _transports(lines: list[str], parser: NcclStreamParser | None = None) -> list[tuple]:
    p = parser or NcclStreamParser()
    events = [e for line in lines for e in p.feed(line)]
    for e in events:
        wire.validate(wire.Event, dict(e, ts=1.0))
    return [(e.get("rank"), e["data"]["transport"], e["data"].get("gdr"), e["data"].get("dev"), e["data"].get("nranks"))
            for e in events if e["data"]["fact"] == "transport"]


def test_a_receive_line_names_the_receiver_and_a_send_line_the_sender():
    # pid 919 prints "0[0] -> 8[0] [receive]" and "8[0] -> 0[0] [send]": it is rank 8 either way
    got = _transports((LOGS / "nccl_socket_connection_closed.log").read_text().splitlines())
    assert got == [(9, "P2P/IPC", None, "1", None), (8, "Socket", "false", "0", None)]


def test_a_combined_log_of_many_processes_names_each_rank_once_per_transport():
    got = _transports((LOGS / "nccl_socket_ib_disabled_mpi.log").read_text().splitlines())
    # the bracket holds the bus id here ("1[2a000]"), the local device is the prefix's "[1]"
    assert got == [(1, "Socket", "false", "1", None), (10, "P2P/IPC", None, "2", None),
                   (15, "Socket", "false", "7", None), (0, "P2P/IPC", None, "0", None)]


def test_nccl_2_4_ring_lines_without_devices_still_name_the_rank():
    got = _transports((LOGS / "nccl_aws_libfabric_ring_2.4.log").read_text().splitlines())
    net = [(r, t) for r, t, *_ in got if t != "P2P/IPC"]
    assert net == [(7, "AWS Libfabric"), (15, "AWS Libfabric"), (23, "AWS Libfabric")]
    assert sorted(r for r, t, *_ in got if t == "P2P/IPC") == [25, 26, 27, 28, 29, 30]


def test_once_the_world_comm_is_known_every_connection_is_its_rank():
    """NCCL 2.19+ prints each communicator's rank before its connections. A subgroup's connections (here a TP group
    of 8 set up first) carry that group's size, so the server can tell its rank numbers from the world's."""
    head = "gpu-3:4242:4300 [4] NCCL INFO "
    lines = [head + "ncclCommInitRank comm 0x55a1 rank 4 nranks 8 cudaDev 4 nvmlDev 4 busId 9d000 commId 0x1 - Init START",
             head + "Channel 00/0 : 4[4] -> 5[5] via P2P/CUMEM/read",
             head + "ncclCommInitRank comm 0x55b2 rank 12 nranks 16 cudaDev 4 nvmlDev 4 busId 9d000 commId 0x2 - Init START",
             head + "comm 0x55b2 rank 12 nRanks 16 nNodes 2 localRanks 8 localRank 4 MNNVL 0",
             head + "Channel 00/0 : 12[4] -> 13[5] via P2P/CUMEM/read",
             head + "Channel 01/0 : 3[4] -> 12[4] [receive] via NET/IB/0/GDRDMA",
             head + "Channel 01/0 : 12[4] -> 3[4] [send] via NET/IB/0/GDRDMA",
             head + "NVLS comm 0x55b2 headRank 0 nHeads 8 nvlsRanks 8 buffSize 1048576 nvlsPerRankSize 201326592 "
                    "nvlsTotalSize 1610612736",
             head + "Connected NVLS tree",
             # a later subgroup (DP, 2 ranks) connects over IB too: still rank 12 of the world
             head + "ncclCommInitRank comm 0x55c3 rank 1 nranks 2 cudaDev 4 nvmlDev 4 busId 9d000 commId 0x3 - Init START",
             head + "Channel 00/0 : 0[4] -> 1[4] [receive] via NET/IB/0/GDRDMA"]
    assert _transports(lines) == [(4, "P2P/CUMEM", None, "4", "8"), (12, "P2P/CUMEM", None, "4", "16"),
                                  (12, "IB", "true", "4", "16"), (12, "NVLS", None, "4", "16")]


def test_processes_sharing_a_file_keep_their_own_ranks():
    p = NcclStreamParser()
    lines = ["n1:100:1 [0] NCCL INFO comm 0xa rank 0 nranks 4 cudaDev 0 busId 1000 - Init COMPLETE",
             "n1:200:1 [1] NCCL INFO comm 0xb rank 1 nranks 4 cudaDev 1 busId 2000 - Init COMPLETE",
             "n1:100:1 [0] NCCL INFO Channel 00/0 : 3[0] -> 0[0] [receive] via NET/IB/0",
             "n1:200:1 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA"]
    assert _transports(lines, p) == [(0, "IB", "false", "0", "4"), (1, "IB", "true", "1", "4")]
    # the same fact again from the same process is not sent twice
    assert _transports(lines[2:], p) == []
