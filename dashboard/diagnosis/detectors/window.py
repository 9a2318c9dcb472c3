"""What the detectors look at: a bounded, recent window of every series, as numpy columns.

Two producers fill it with the same row layouts: :mod:`dashboard.diagnosis.loader` from the database (one bounded
index range scan per series) and :class:`dashboard.diagnosis.detectors.buffer.WindowBuffer` from wire batches (the
fault-injection suite and the pure tests). Nothing here imports Django.

Nodes are referred to by index into ``Window.nodes`` inside the tables (fast integer group-bys) and by host name in
everything a person reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

# Row layouts: numeric columns first (floats, NaN for null), then object columns (lists, dicts, strings).
STEP_NUM = ("run", "rank", "step", "ts", "step_time_s", "data_wait_s", "compute_s", "comm_s", "comm_arrive_s",
            "tokens", "mem_allocated_bytes", "mem_reserved_bytes", "mem_total_bytes")
STEP_OBJ = ("groups",)  # per process group timings (wire GroupTiming dicts), None where the hooks sent none
GPU_NUM = ("node", "gpu", "ts", "util_gpu_pct", "sm_clock_mhz", "sm_clock_max_mhz", "temp_c", "power_w",
           "power_limit_w", "ecc_sbe_volatile", "ecc_dbe_volatile", "retired_pages_pending", "remap_pending",
           "remap_failure", "remap_uncorrectable", "pcie_replay_total", "pcie_gen", "pcie_gen_max", "pcie_width",
           "pcie_width_max", "nvlink_links_up", "nvlink_links_total", "nvlink_crc_errors_total",
           "nvlink_replay_errors_total", "nvlink_recovery_errors_total")
GPU_OBJ = ("throttle_reasons", "unavailable")
# suspect: 1 where the sample shows trouble by itself (:func:`port_suspect`), worked out once as the row enters a
# window (the loader's held rows, the buffer) instead of at every pass over every row.
PORT_NUM = ("node", "ts", "port", "rate_gbps", "suspect")
PORT_OBJ = ("device", "state", "counters")
# InfiniBand / RoCE error counters whose growth is trouble.
PORT_ERRORS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
               "port_rcv_remote_physical_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
               "port_xmit_discards")
PROBE_NUM = ("node", "peer", "ts", "sent", "lost", "rtt_ms", "bw_gbps")

# How much history a pass looks at: seconds per series, except steps (the last N steps of each run, so slow steps
# still give enough of them). Bounded, so the cost of a pass never grows with the history kept. The most steps a
# detector looks at is 16 (hang, efficiency) plus the newest, often half-reported one: steps are the largest read of
# a pass (one row per rank and step), so no more than that is read.
SPANS = {"gpus": 20.0, "ports": 20.0, "probes": 15.0, "hosts": 10.0, "events": 120.0, "checkpoints": 6 * 3600.0}
STEP_SPAN = 18
LOSS_SPAN = 256  # steps of loss history per run: a spike is judged against the run's own recent loss


def port_suspect(state: Any, counters: dict[str, Any] | None) -> float:
    """1.0 where a port sample shows trouble by itself: a state other than ACTIVE, or an error or link-down count.
    (A low rate needs the cluster's rate, so the pass judges that.) Checked at every pass, the 43,000 port rows of a
    2,048-node window cost 0.1 s a pass; each row is checked once now."""
    if state and not str(state).upper().endswith("ACTIVE"):
        return 1.0
    # any(map(c.get, ...)): no generator frame per row.
    return 1.0 if counters and any(map(counters.get, PORT_ERRORS)) else 0.0


class Table:
    """Equal-length columns. Numeric ones are float arrays (NaN = null); object ones are numpy object arrays."""

    def __init__(self, num: dict[str, np.ndarray], obj: dict[str, np.ndarray] | None = None) -> None:
        self.num = num
        self.obj = obj or {}
        self.n = len(next(iter(num.values()))) if num else 0

    @classmethod
    def from_rows(cls, num_cols: Sequence[str], obj_cols: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
        k = len(num_cols)
        if not rows:
            return cls({c: np.empty(0) for c in num_cols}, {c: np.empty(0, dtype=object) for c in obj_cols})
        cols = list(zip(*rows, strict=True))
        num = {c: np.array(cols[i], dtype=float) for i, c in enumerate(num_cols)}
        obj = {}
        for j, c in enumerate(obj_cols):
            arr = np.empty(len(rows), dtype=object)
            arr[:] = cols[k + j]
            obj[c] = arr
        return cls(num, obj)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, name: str) -> np.ndarray:
        return self.num[name] if name in self.num else self.obj[name]

    def take(self, index: np.ndarray) -> Table:
        return Table({c: v[index] for c, v in self.num.items()}, {c: v[index] for c, v in self.obj.items()})


@dataclass
class RankInfo:
    node: str | None
    gpu: int | None
    meta: dict[str, Any]


class HeldRanks(dict[int, RankInfo]):
    """A run's ranks as the loader hands them over: the same object from pass to pass while none of them changed
    (:func:`dashboard.diagnosis.loader._ranks`), so what the detectors work out of a 16,384-rank run (the ranks on
    each host, the distinct environments, the nodes it runs on) is worked out once and kept in ``memo``
    (:func:`of_ranks`), not again at every pass. Read-only: a detector writing into it would change what the next
    pass's memo says, so it fails loudly instead. A plain dict (a window built by hand) has no memo."""

    __slots__ = ("memo",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memo: dict[Hashable, Any] = {}

    def _read_only(self, *_: Any, **__: Any) -> Any:
        raise TypeError("a run's held ranks are read-only")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only  # type: ignore

    def __reduce__(self) -> tuple[Any, ...]:
        return HeldRanks, (dict(self),)  # copied or pickled through the constructor, not item by item


def of_ranks(ranks: dict[int, RankInfo], key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, a function of ``ranks`` (and of what ``key`` names) alone, kept for as long as ``ranks`` is the
    loader's held object; worked out afresh for any other dict. Callers only read what it returns."""
    memo = getattr(ranks, "memo", None)
    if memo is None:
        return compute()
    try:
        return memo[key]
    except KeyError:
        got = memo[key] = compute()
        return got


def run_nodes(run: RunInfo) -> frozenset[str]:
    """The nodes the run's ranks run on (kept with its held ranks)."""
    return of_ranks(run.ranks, "nodes", lambda: frozenset(i.node for i in run.ranks.values() if i.node))


@dataclass
class RunInfo:
    name: str
    world_size: int | None
    meta: dict[str, Any]
    ranks: dict[int, RankInfo]
    last_step: int | None = None
    last_step_ts: float | None = None
    checkpoints: list[tuple[float, int]] = field(default_factory=list)  # (ts, step), oldest first
    id: int | None = None  # database id when loaded from the database


@dataclass
class Window:
    now: float
    nodes: list[str]
    steps: Table
    gpus: Table
    ports: Table
    probes: Table
    events: list[dict[str, Any]]
    hosts: dict[str, dict[str, Any]]  # host -> latest host sample (cpu_pct, nfs, ts; interfaces: its newest list)
    runs: list[RunInfo]
    last_heard: dict[str, float]  # host -> newest timestamp of anything it sent (for every node we expect)
    interconnect: str = "ib"
    gpu_bus: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, "bb:dd") -> GPU index
    span: dict[str, float] = field(default_factory=dict)  # series -> seconds of history this window holds
    # The latest beat of each rank (wire RankBeat fields + "host", the agent that forwarded it, and "received",
    # server time): where each training process is now, from the live state (read when first asked: ``Beats``).
    beats: Sequence[dict[str, Any]] = field(default_factory=list)
    # The NCCL events that are state of the active runs (the transport, network, fallback its ranks reported), over
    # the runs' lifetime rather than the event window: a socket fallback holds until the ranks report another one.
    nccl_state: list[dict[str, Any]] = field(default_factory=list)
    # host -> (rack, switch) where known ("" for an unknown part): the path detector names a leaf switch from it.
    places: dict[str, tuple[str, str]] = field(default_factory=dict)
    # "ib", "roce" or "eth" (``interconnect`` says only what NCCL should use, and RoCE is "ib" there); "" = unknown.
    fabric: str = ""
    # run name -> [n x 3] (step, ts, loss), oldest first: one value per step (rank 0's, or the lowest reporting rank)
    losses: dict[str, np.ndarray] = field(default_factory=dict)
    # How late this server receives what the nodes send: host -> seconds from its newest received batch's ``sent_at``
    # to its arrival, and the median over the nodes (the server's own ingest lag). A node is silent against what
    # could have arrived by now, not against the server's clock alone (``nodes_down``). Empty / 0 when unknown.
    ingest_delay: dict[str, float] = field(default_factory=dict)
    ingest_lag_s: float = 0.0
    # host -> [n x 2] (arrival on this server's clock, seconds after its sent_at), oldest first, of the newest batches
    # of each node whose newest batch arrived well after the cluster's (``loader._arrivals``; usually none): a steady
    # delay is the node's clock behind, a falling one its agent replaying a spool (``network.clock_behind``).
    arrivals: dict[str, np.ndarray] = field(default_factory=dict)
    # host -> seconds between its two newest batches' sent_at, where both are known: the agent posts several seconds
    # of samples at once when the server asks it to (4 s at 2,048 nodes), and is not quiet between two posts.
    post_interval: dict[str, float] = field(default_factory=dict)
    # When this server's current stretch of listening for the agents began (dashboard.ingest.listening): nothing
    # could be heard before it, so a silence counts from the later of a node's newest word and this. -inf: always.
    listening_since: float = float("-inf")
    # The runs' [rank x step] grids, built once for the detectors that ask (steps.run_steps): not part of the data.
    grids: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def node_index(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(self.nodes)}

    def arrival_delay(self, host: str) -> float:
        """How late the node's batches reach this server: its newest batch's delay, or the cluster's median,
        whichever is more (``network.arrival_slack`` bounds it for the detectors)."""
        return max(self.ingest_lag_s, self.ingest_delay.get(host, 0.0))


def bus_key(pci_bus_id: str | None) -> str | None:
    """ "00000000:18:00.0" and "0000:18:00" -> "18:00": the bus and device, the part every tool prints alike."""
    if not pci_bus_id:
        return None
    parts = pci_bus_id.lower().split(":")
    if len(parts) < 2:
        return None
    return f"{parts[-2][-2:]}:{parts[-1].split('.')[0][:2]}"


def node_names(rows: Iterable[str]) -> tuple[list[str], dict[str, int]]:
    names = sorted(set(rows))
    return names, {h: i for i, h in enumerate(names)}
