"""A simulated GPU cluster running one data-parallel training job, producing real wire batches.

The step model is DDP's: every rank loads its batch (data wait), computes, then joins an all-reduce that finishes
only when the last rank arrives. So every rank's *step time* is the same; the culprit shows in its own data wait or
compute, the others show it as time spent waiting in the collective (``comm_s``), and the network shows in the
all-reduce itself and in the pairwise probes. Faults from the scenario bend exactly the signals a real fault bends.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from clusterdx.wire import WIRE_VERSION
from collectors.sim.scenario import Fault, Scenario

GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEM = 80 * 1024**3
SM_MAX_MHZ = 1980.0
TOKENS_PER_RANK_STEP = 16_384
HEALTHY_ENV = {"NCCL_IB_HCA": "mlx5", "NCCL_IB_TIMEOUT": "22", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}


def node_name(i: int) -> str:
    return f"node-{i:03d}"


def node_place(i: int, nodes_per_rack: int) -> dict[str, str]:
    """Rack and leaf switch of node ``i``: one top-of-rack leaf per rack, as in most GPU pods."""
    rack = i // nodes_per_rack
    return {"rack": f"rack-{rack:02d}", "switch": f"leaf-{rack:02d}"}


@dataclass
class _Gpu:
    sbe: int = 0
    dbe: int = 0
    remap_pending: bool = False
    remap_uncorrectable: int = 0
    pcie_replay: int = 0
    lost: bool = False  # fell off the bus
    xid_sent: set[float] = field(default_factory=set)


@dataclass
class _Node:
    gpus: list[_Gpu]
    port_counters: dict[str, int] = field(default_factory=dict)
    nccl_logged: bool = False
    nccl_init: bool = False


INTERFACES_EVERY = 300  # batches: the agent sends its interface list when it changes and every 300 s


class SimCluster:
    """Call :meth:`tick` once per simulated second; it returns one batch per live node."""

    def __init__(self, scenario: Scenario, start_ts: float, agent_prefix: str = "sim") -> None:
        self.s = scenario
        self.start = start_ts
        self.rng = random.Random(scenario.seed)
        self.nodes = [_Node([_Gpu() for _ in range(scenario.gpus_per_node)]) for _ in range(scenario.nodes)]
        self.seq = [0] * scenario.nodes
        self.agent_prefix = agent_prefix
        self.step = 0
        self.step_clock = start_ts  # when the current step started
        self.last_tick = start_ts
        self.meta_sent = False
        self.last_checkpoint = (0, start_ts)
        self.pending_steps: list[list[dict[str, Any]]] = [[] for _ in range(scenario.nodes)]
        self.pending_events: list[list[dict[str, Any]]] = [[] for _ in range(scenario.nodes)]
        self.stalled_since: float | None = None  # when the last step ended, while no step can finish
        self.dead: set[int] = set()  # ranks whose process has exited (they said so once, then went silent)

    # -- faults ------------------------------------------------------------------------------------------------
    def _active(self, t: float, kind: str) -> list[Fault]:
        return [f for f in self.s.faults if f.kind == kind and f.active(t - self.start)]

    def _rank_fault(self, t: float, kind: str, rank: int) -> Fault | None:
        return next((f for f in self._active(t, kind) if f.rank == rank), None)

    def _node_fault(self, t: float, kind: str, node: int) -> Fault | None:
        return next((f for f in self._active(t, kind) if f.node == node), None)

    def node_down(self, t: float, node: int) -> bool:
        return self._node_fault(t, "node_down", node) is not None

    def _stalled(self, t: float) -> bool:
        """No step can finish: a deadlock, a dead node or a lost GPU holds every rank in the all-reduce."""
        if any(self._active(t, k) for k in ("hang", "node_down", "rank_killed", "rank_frozen", "loader_stuck")):
            return True
        return any(g.lost for n in self.nodes for g in n.gpus)

    # -- steps -------------------------------------------------------------------------------------------------
    def _rank_times(self, t: float, rank: int) -> tuple[float, float]:
        base = self.s.step_time_s
        data = max(0.0, self.rng.gauss(0.02 * base, 0.004 * base))
        compute = base * (1 + self.rng.gauss(0, 0.015))
        if (f := self._rank_fault(t, "data_starvation", rank)) is not None:
            data += f.magnitude * base * (0.8 + 0.4 * self.rng.random())
        if (f := self._rank_fault(t, "straggler", rank)) is not None:
            compute *= 1 + f.magnitude
        return data, compute

    def _allreduce_s(self, t: float) -> float:
        ar = 0.12 * self.s.step_time_s * (1 + 0.05 * math.log2(max(2, self.s.nodes)))
        for f in self._active(t, "slow_link"):
            ar *= 1 + f.magnitude * 0.5
        for _ in self._active(t, "nccl_socket_fallback"):
            ar *= 3.0
        return ar * (1 + abs(self.rng.gauss(0, 0.03)))

    def _advance_steps(self, now: float) -> None:
        g = self.s.gpus_per_node
        while True:
            t = self.step_clock
            if self._stalled(t):
                if self.stalled_since is None:
                    self.stalled_since = t
                self.step_clock = now  # the clock runs, no step completes
                return
            self.stalled_since = None
            times = [self._rank_times(t, r) for r in range(self.s.world_size)]
            arrive = [d + c for d, c in times]
            step_time = max(arrive) + self._allreduce_s(t)
            if t + step_time > now:
                return
            end = t + step_time
            self.step += 1
            for r, (data, compute) in enumerate(times):
                self.pending_steps[r // g].append(self._step_row(r, end, step_time, data, compute, arrive[r], t))
            self.step_clock = end
            if self.step % self.s.checkpoint_every == 0 and not self._active(end, "checkpoint_stop"):
                self.last_checkpoint = (self.step, end)
                self.meta_sent = False  # checkpoint position travels in RunMeta
                for n in range(self.s.nodes):
                    self.pending_events[n].append(
                        {"ts": end, "kind": "checkpoint", "severity": "info", "run": self.s.run, "step": self.step,
                         "rank": n * g, "message": f"checkpoint saved at step {self.step}"})

    def _step_row(self, rank: int, end: float, step_time: float, data: float, compute: float, arrive: float,
                  start: float) -> dict[str, Any]:
        mem_frac = 0.62
        if (f := self._rank_fault(start, "memory_pressure", rank)) is not None:
            elapsed = start - self.start - f.at_s
            mem_frac = min(f.magnitude, 0.62 + (f.magnitude - 0.62) * min(1.0, elapsed / 30))
        return {
            "run": self.s.run, "rank": rank, "step": self.step, "ts": end, "step_time_s": step_time,
            "data_wait_s": data, "compute_s": compute, "comm_s": step_time - arrive, "comm_arrive_s": arrive,
            "tokens": TOKENS_PER_RANK_STEP, "samples": 8,
            "metrics": {"loss": 2.0 + 6.0 / math.sqrt(self.step + 1), "grad_norm": 1.0 + 0.1 * self.rng.random()},
            "mem_allocated_bytes": int(GPU_MEM * mem_frac), "mem_reserved_bytes": int(GPU_MEM * min(0.99, mem_frac + 0.08)),
            "mem_total_bytes": GPU_MEM,
        }

    # -- beats -----------------------------------------------------------------------------------------------------
    def _beats(self, now: float, n: int) -> list[dict[str, Any]]:
        """Each rank's beat, as the hooks' shipping thread sends it: a killed or frozen rank sends none; the
        survivors of a kill under gloo (``survivors = "crash"``) die of the lost peer, say so once, then go silent."""
        g, out = self.s.gpus_per_node, []
        killed = self._active(now, "rank_killed")
        crash = next((f for f in killed if f.params.get("survivors") == "crash"), None)
        for rank in range(n * g, (n + 1) * g):
            if rank in self.dead or self._rank_fault(now, "rank_killed", rank) or \
                    self._rank_fault(now, "rank_frozen", rank):
                continue
            beat = {"run": self.s.run, "rank": rank, "ts": now, "step": self.step, "pid": 4000 + rank}
            if crash is not None:
                self.dead.add(rank)
                self._crash_events(now, n, rank, crash)
                out.append({**beat, "state": "crashed", "state_s": 0.0})
            elif (f := self._rank_fault(now, "loader_stuck", rank)) is not None:
                out.append({**beat, "state": "data", "state_s": now - self.start - f.at_s})
            elif self.stalled_since is not None:
                out.append({**beat, "state": "step", "state_s": now - self.stalled_since})
            else:
                elapsed, fetch = now - self.step_clock, 0.02 * self.s.step_time_s
                out.append({**beat, "state": "data" if elapsed < fetch else "step",
                            "state_s": elapsed if elapsed < fetch else elapsed - fetch})
        return out

    def _crash_events(self, now: float, n: int, rank: int, killed: Fault) -> None:
        peer = (killed.rank or 0) // self.s.gpus_per_node
        text = (f"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                f"[10.0.0.{peer + 1}]:{29500 + (killed.rank or 0)}: Connection reset by peer")
        self.pending_events[n].append({"ts": now, "kind": "error", "severity": "error", "run": self.s.run,
                                       "rank": rank, "step": self.step, "message": text,
                                       "data": {"exception": "RuntimeError"}})
        self.pending_events[n].append({"ts": now, "kind": "hook", "severity": "error", "run": self.s.run,
                                       "rank": rank, "step": self.step, "message": f"rank {rank} crashed",
                                       "data": {"state": "crashed"}})

    # -- per-node records --------------------------------------------------------------------------------------
    def _gpu_sample(self, now: float, n: int, i: int, busy: float) -> dict[str, Any]:
        gpu = self.nodes[n].gpus[i]
        rank = n * self.s.gpus_per_node + i
        sample: dict[str, Any] = {
            "ts": now, "index": i, "uuid": f"GPU-{n:04d}{i:04d}-sim", "name": GPU_NAME,
            "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
        }
        if gpu.lost:
            sample["unavailable"] = {"util_gpu_pct": "GPU is lost (Xid 79)"}
            return sample
        throttle: list[str] = []
        clock = SM_MAX_MHZ - abs(self.rng.gauss(0, 15))
        temp = 62 + 8 * busy + self.rng.gauss(0, 1.5)
        if (f := self._rank_fault(now, "straggler", rank)) is not None:
            clock = SM_MAX_MHZ / (1 + f.magnitude)
            temp = 91 + self.rng.gauss(0, 1)
            throttle = ["hw_thermal_slowdown", "sw_thermal_slowdown"]
        if (f := self._node_fault(now, "ecc_storm", n)) is not None and f.gpu == i:
            gpu.sbe += self.rng.randint(40, 120)
            if now - self.start - f.at_s >= float(f.params.get("dbe_after_s", 20)) and not gpu.dbe:
                gpu.dbe, gpu.remap_pending, gpu.remap_uncorrectable = 1, True, 1
                self.pending_events[n].append(self._xid_event(now, i, 48, "An uncorrectable double bit error"))
        util = max(0.0, min(100.0, 100 * busy + self.rng.gauss(0, 2)))
        mem = int(GPU_MEM * 0.7)
        sample.update({
            "util_gpu_pct": util, "util_mem_pct": util * 0.45, "mem_used_bytes": mem, "mem_total_bytes": GPU_MEM,
            "temp_c": temp, "power_w": 120 + 560 * busy, "power_limit_w": 700.0, "sm_clock_mhz": clock,
            "sm_clock_max_mhz": SM_MAX_MHZ, "mem_clock_mhz": 2619.0, "mem_clock_max_mhz": 2619.0,
            "throttle_reasons": throttle, "ecc_sbe_volatile": gpu.sbe, "ecc_dbe_volatile": gpu.dbe,
            "ecc_sbe_aggregate": gpu.sbe, "ecc_dbe_aggregate": gpu.dbe, "remap_correctable": 0,
            "remap_uncorrectable": gpu.remap_uncorrectable, "remap_pending": gpu.remap_pending, "remap_failure": False,
            "pcie_replay_total": gpu.pcie_replay, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16,
            "pcie_width_max": 16, "nvlink_links_up": 18, "nvlink_links_total": 18, "nvlink_crc_errors_total": 0,
            "nvlink_replay_errors_total": 0, "nvlink_recovery_errors_total": 0,
        })
        return sample

    def _xid_event(self, now: float, gpu: int, code: int, message: str) -> dict[str, Any]:
        pci = f"0000:{0x18 + 0x10 * gpu:02x}:00"
        return {"ts": now, "kind": "xid", "severity": "critical" if code in (48, 79, 94, 95) else "error",
                "code": code, "gpu_index": gpu, "pci_bus_id": pci,
                "message": f"NVRM: Xid (PCI:{pci}): {code}, pid=4242, name=python, {message}"}

    def _inject_events(self, now: float, n: int) -> None:
        for f in self._active(now, "xid"):
            if f.node != n or f.at_s in self.nodes[n].gpus[f.gpu or 0].xid_sent:
                continue
            gpu = self.nodes[n].gpus[f.gpu or 0]
            gpu.xid_sent.add(f.at_s)
            code = int(f.params.get("code", 79))
            self.pending_events[n].append(self._xid_event(now, f.gpu or 0, code, "GPU has fallen off the bus."
                                                          if code == 79 else "Xid reported by the driver"))
            if code == 79:
                gpu.lost = True
        if self._node_fault(now, "nccl_socket_fallback", n) and not self.nodes[n].nccl_logged:
            self.nodes[n].nccl_logged = True
            self.pending_events[n].append({
                "ts": now, "kind": "nccl", "severity": "warning", "run": self.s.run, "rank": n * self.s.gpus_per_node,
                "message": f"{node_name(n)}:4242:4242 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.{n + 1}<0>",
                "data": {"transport": "Socket", "network": "Socket"},
            })

    def _interfaces(self, n: int) -> list[dict[str, Any]]:
        """The node's interfaces as the agent reports them (on change, and every few minutes): the Ethernet NCCL
        bootstraps over, and one InfiniBand port (IPoIB) per GPU."""
        return [{"name": "lo", "state": "unknown", "kind": "loopback", "virtual": True, "mtu": 65536,
                 "addresses": ["127.0.0.1/8"]},
                {"name": "eth0", "state": "up", "kind": "ether", "virtual": False, "mtu": 9000, "speed_mbps": 100_000,
                 "addresses": [f"10.0.{n // 250}.{n % 250 + 1}/16"]},
                *({"name": f"ib{i}", "state": "up", "kind": "infiniband", "virtual": False, "mtu": 4092,
                   "speed_mbps": 400_000, "addresses": [f"10.{100 + i}.{n // 250}.{n % 250 + 1}/16"]}
                  for i in range(self.s.gpus_per_node))]

    def _nccl_init_lines(self, n: int, i: int) -> list[str]:
        """What NCCL_DEBUG=INFO prints at init for local rank ``i`` of node ``n``: its place in the world
        communicator, its ring neighbour on the node (NVLink P2P) and its rail peer on the next node over its own
        HCA, with GPUDirect RDMA; sockets on a node whose NCCL fell back to them."""
        g, world = self.s.gpus_per_node, self.s.world_size
        rank, host = n * g + i, node_name(n)
        prefix = f"{host}:{4000 + i}:{4000 + i} [{i}] NCCL INFO"
        socket = self._node_fault(self.start, "nccl_socket_fallback", n) is not None
        net = "NET/Socket/0" if socket else f"NET/IB/{i}/GDRDMA"
        lines = [f"{prefix} comm 0x7f{rank:06x} rank {rank} nRanks {world} nNodes {self.s.nodes} localRanks {g} "
                 f"localRank {i} MNNVL 0",
                 f"{prefix} Using network {'Socket' if socket else 'IB'}"]
        if g > 1:
            lines.append(f"{prefix} Channel 00/0 : {rank}[{i}] -> {n * g + (i + 1) % g}[{(i + 1) % g}] via P2P/IPC")
        if self.s.nodes > 1:
            peer = ((n + 1) % self.s.nodes) * g + i
            lines.append(f"{prefix} Channel {i % 32:02d}/1 : {rank}[{i}] -> {peer}[{i}] [send] via {net}")
        return lines

    def _nccl_init_events(self, now: float, n: int) -> list[dict[str, Any]]:
        from collectors.doctor.nccl import NcclStreamParser  # the agent's own parser: the events it would send

        out = []
        for i in range(self.s.gpus_per_node):
            parser = NcclStreamParser()  # one per process, as the agent keeps one per log file
            for line in self._nccl_init_lines(n, i):
                out += [{**e, "ts": now, "run": self.s.run} for e in parser.feed(line)]
        return out

    def _port_sample(self, now: float, n: int) -> dict[str, Any]:
        counters = {"symbol_error": 0, "link_downed": 0, "link_error_recovery": 0, "port_rcv_errors": 0,
                    "port_xmit_discards": 0, "port_xmit_wait": self.rng.randint(0, 50)}
        state, phys = "ACTIVE", "LinkUp"
        if (f := self._node_fault(now, "link_flap", n)) is not None:
            counters["symbol_error"] = self.rng.randint(50, 500)
            counters["link_error_recovery"] = 1
            if int(now - self.start - f.at_s) % 10 < 3:
                state, phys, counters["link_downed"] = "DOWN", "Polling", 1
        return {"ts": now, "device": "mlx5_0", "port": 1, "state": state, "phys_state": phys, "rate_gbps": 400.0,
                "link_layer": "InfiniBand", "interval_s": 1.0, "xmit_bytes_per_s": 2.1e10, "rcv_bytes_per_s": 2.1e10,
                "counters": counters}

    def _probes(self, now: float, n: int) -> list[dict[str, Any]]:
        peers = [p for p in range(self.s.nodes) if p != n]
        if len(peers) > 8:  # pingmesh: a rotating sample in a large cluster, staggered per node (as the real
            # probe source does) so every node is probed by about eight peers every second, not all at once
            k = (int(now) + 8 * n) % len(peers)
            peers = (peers[k:] + peers[:k])[:8]
        # One bulk transfer per node and round, as the real source sends, to the peer a rotating shift away: the
        # shift is the same for every node in a round, so each node receives exactly one transfer and none measures
        # a share of its link (the server credits transfers that arrive together with their share).
        bulk = (n + 1 + int(now) % (self.s.nodes - 1)) % self.s.nodes if self.s.nodes > 1 else None
        if bulk is not None and bulk not in peers:
            peers.append(bulk)
        out = []
        for p in peers:
            if self.node_down(now, p):
                out.append({"ts": now, "peer": node_name(p), "sent": 5, "lost": 5})
                continue
            rtt, bw = 0.08 + abs(self.rng.gauss(0, 0.01)), 180.0 + self.rng.gauss(0, 5)
            for f in self._active(now, "slow_link"):
                if f.node in (n, p):
                    if f.params.get("mode", "delay") == "delay":
                        rtt += f.magnitude
                    bw /= 1 + f.magnitude
            row = {"ts": now, "peer": node_name(p), "sent": 5, "lost": 0, "rtt_ms": rtt, "rtt_p99_ms": rtt * 1.3}
            if p == bulk:
                row["bw_gbps"] = max(0.1, bw)
            out.append(row)
        return out

    def _run_meta(self, now: float, n: int) -> list[dict[str, Any]]:
        g = self.s.gpus_per_node
        metas = []
        for i in range(g):
            rank = n * g + i
            env = dict(HEALTHY_ENV)
            if self._rank_fault(now, "nccl_env_drift", rank) is not None:
                env.update({"NCCL_IB_TIMEOUT": "14", "NCCL_ALGO": "Ring"})
            if self._node_fault(now, "nccl_socket_fallback", n) is not None:
                env["NCCL_IB_DISABLE"] = "1"
            metas.append({
                "run": self.s.run, "rank": rank, "world_size": self.s.world_size, "ts": now, "local_rank": i,
                "host": node_name(n), "gpu_index": i, "gpu_name": GPU_NAME, "parallel": {"dp": self.s.world_size},
                "versions": {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3"}, "env": env,
                "dataloader": {"batch_size": 8, "num_workers": 2 if rank % 7 == 5 else 8, "pin_memory": True,
                               "prefetch_factor": 2, "persistent_workers": True, "sampler": "DistributedSampler",
                               "dataset_path": "/mnt/nfs/datasets/tokens"},
                "params": 1_300_000_000, "flops_per_token": 6 * 1.3e9, "peak_flops": 989e12, "dtype": "bf16",
                "last_checkpoint_step": self.last_checkpoint[0], "last_checkpoint_ts": self.last_checkpoint[1],
            })
        return metas

    def tick(self, now: float) -> list[dict[str, Any]]:
        """Advance to ``now`` and return this interval's batches (nodes that are down send nothing)."""
        self._advance_steps(now)
        stalled = self._stalled(now)
        resend_meta = not self.meta_sent or any(
            f.active(now - self.start) != f.active(self.last_tick - self.start)
            for f in self.s.faults if f.kind in ("nccl_env_drift", "nccl_socket_fallback"))
        batches = []
        for n in range(self.s.nodes):
            if self.node_down(now, n):
                self.pending_steps[n].clear()
                continue
            self._inject_events(now, n)
            if self.s.nccl_logs and not self.nodes[n].nccl_init:
                self.nodes[n].nccl_init = True
                self.pending_events[n] += self._nccl_init_events(now, n)
            beats = self._beats(now, n)
            busy = 0.97 if stalled else 0.93  # a hung NCCL kernel spins at 100%: utilisation hides a hang
            batch: dict[str, Any] = {
                "v": WIRE_VERSION, "agent_id": f"{self.agent_prefix}-{node_name(n)}", "seq": self.seq[n],
                "host": node_name(n), "sent_at": now, "topology": node_place(n, self.s.nodes_per_rack),
                "gpus": [self._gpu_sample(now, n, i, busy) for i in range(self.s.gpus_per_node)],
                "hosts": [{"ts": now, "cpu_pct": 35 + self.rng.gauss(0, 3), "load1": 12.0,
                           "mem_used_bytes": 600 * 1024**3, "mem_total_bytes": 2048 * 1024**3,
                           "nfs": [{"mount": "/mnt/nfs", "server": "nfs-1:/export", "ops_per_s": 120.0,
                                    "rtt_ms": 0.9, "exe_ms": 1.1}],
                           **({"interfaces": self._interfaces(n)} if self.seq[n] % INTERFACES_EVERY == 0 else {})}],
                "ports": [self._port_sample(now, n)],
                "events": self.pending_events[n], "steps": self.pending_steps[n], "probes": self._probes(now, n),
                "runs": self._run_meta(now, n) if resend_meta else [], "beats": beats,
            }
            self.pending_events[n], self.pending_steps[n] = [], []
            self.seq[n] += 1
            batches.append(batch)
        self.meta_sent = True
        self.last_tick = now
        return batches
