"""Scenario files for the simulated cluster: the cluster's shape and the faults to inject, in TOML.

    [cluster]
    nodes = 4                 # node-000 .. node-003
    gpus_per_node = 8         # one rank per GPU: rank = node * gpus_per_node + gpu
    run = "demo-run"
    step_time_s = 0.8         # healthy compute per step
    seed = 1
    nodes_per_rack = 8        # rack-00 holds node-000 .. node-007, behind leaf switch leaf-00

    [[fault]]
    kind = "data_starvation"  # see FAULT_KINDS
    at_s = 30                 # seconds after the simulation starts
    duration_s = 60           # omitted: until the end
    rank = 5                  # or node = 2, or node = 2 + gpu = 3
    magnitude = 0.6           # fault-specific strength (seconds of extra wait, slowdown factor, ...)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# kind -> (what it targets, what it does). The simulator implements every row; diagnosis must name each subject.
FAULT_KINDS: dict[str, tuple[str, str]] = {
    "data_starvation": ("rank", "the rank's DataLoader is slow: data wait grows by `magnitude` seconds per step"),
    "straggler": ("rank", "the rank's GPU is thermally throttled: clocks drop, compute takes (1 + magnitude) x"),
    "slow_link": ("node", "the node's network is slow: probes to it show +magnitude ms RTT (or low bandwidth), "
                          "all-reduce slows for everyone"),
    "link_flap": ("node", "the node's IB port goes down and up: link_downed and symbol errors rise"),
    "ecc_storm": ("gpu", "corrected ECC errors climb fast; after `dbe_after_s` an uncorrectable error and a pending remap"),
    "xid": ("gpu", "the GPU reports Xid `code` (default 79: fallen off the bus); 79 stops the GPU and hangs the run"),
    "node_down": ("node", "the node's agent goes silent and its ranks stop; the others hang in the all-reduce"),
    "hang": ("run", "no rank makes progress although every agent is alive (a collective deadlock)"),
    "nccl_socket_fallback": ("node", "NCCL on the node falls back to sockets: NET/Socket lines, slower all-reduce"),
    "nccl_env_drift": ("rank", "the rank runs with different NCCL_* settings than the others"),
    "checkpoint_stop": ("run", "checkpoints stop being written"),
    "memory_pressure": ("rank", "allocated memory creeps up to `magnitude` (fraction of the GPU's memory)"),
    "rank_killed": ("rank", "the rank's process is killed (SIGKILL, the OOM killer): its beats stop, the run stalls; "
                            "the others wait in the all-reduce, or die of the lost peer with survivors = \"crash\""),
    "rank_frozen": ("rank", "the rank's process is stopped (SIGSTOP, a debugger): its beats stop while its node's "
                            "agent and the other ranks keep reporting; the run stalls"),
    "loader_stuck": ("rank", "the rank's input pipeline blocks (a dead worker, a hung read): it beats `data` while "
                             "the others wait in the all-reduce; the run stalls"),
}


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float
    duration_s: float | None = None
    node: int | None = None
    gpu: int | None = None
    rank: int | None = None
    magnitude: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)

    def active(self, t: float) -> bool:
        return t >= self.at_s and (self.duration_s is None or t < self.at_s + self.duration_s)


@dataclass(frozen=True)
class Scenario:
    nodes: int = 4
    gpus_per_node: int = 8
    run: str = "demo-run"
    step_time_s: float = 0.8
    seed: int = 1
    checkpoint_every: int = 200
    nodes_per_rack: int = 8
    # NCCL_DEBUG=INFO init lines per rank (communicator, channels, network), parsed by the agent's own NCCL parser
    # into the events the run page's NCCL panel draws. Off by default: benchmarks replay a few seconds of batches.
    nccl_logs: bool = False
    faults: tuple[Fault, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


_CLUSTER_KEYS = {"nodes", "gpus_per_node", "run", "step_time_s", "seed", "checkpoint_every", "nodes_per_rack",
                 "nccl_logs"}
_FAULT_KEYS = {"kind", "at_s", "duration_s", "node", "gpu", "rank", "magnitude"}


def parse(data: dict[str, Any], **overrides: Any) -> Scenario:
    cluster = dict(data.get("cluster", {}))
    unknown = set(cluster) - _CLUSTER_KEYS
    if unknown:
        raise ScenarioError(f"[cluster] has unknown keys: {', '.join(sorted(unknown))}")
    cluster.update({k: v for k, v in overrides.items() if v is not None})
    scenario = Scenario(**cluster)
    if type(scenario.nodes_per_rack) is not int or scenario.nodes_per_rack < 1:
        raise ScenarioError(f"[cluster] nodes_per_rack must be a whole number >= 1, got {scenario.nodes_per_rack!r}")
    faults = []
    for i, raw in enumerate(data.get("fault", [])):
        kind = raw.get("kind")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"fault #{i + 1}: unknown kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        fixed = {k: raw[k] for k in _FAULT_KEYS if k in raw}
        params = {k: v for k, v in raw.items() if k not in _FAULT_KEYS}
        fault = Fault(**fixed, params=params)
        _check_target(fault, scenario, i + 1)
        faults.append(fault)
    return Scenario(**{**scenario.__dict__, "faults": tuple(faults)})


def _check_target(fault: Fault, s: Scenario, n: int) -> None:
    target = FAULT_KINDS[fault.kind][0]
    if target == "rank" and not (fault.rank is not None and 0 <= fault.rank < s.world_size):
        raise ScenarioError(f"fault #{n} ({fault.kind}) needs rank in 0..{s.world_size - 1}")
    if target in ("node", "gpu") and not (fault.node is not None and 0 <= fault.node < s.nodes):
        raise ScenarioError(f"fault #{n} ({fault.kind}) needs node in 0..{s.nodes - 1}")
    if target == "gpu" and not (fault.gpu is not None and 0 <= fault.gpu < s.gpus_per_node):
        raise ScenarioError(f"fault #{n} ({fault.kind}) needs gpu in 0..{s.gpus_per_node - 1}")


def load(path: str | Path | None, **overrides: Any) -> Scenario:
    if path is None:
        return parse({}, **overrides)
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return parse(data, **overrides)
