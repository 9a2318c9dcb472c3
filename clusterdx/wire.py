"""The wire format: the single source of truth for everything node agents and training hooks send.

Standard library only, so the agent, the training hooks and the server all import this one module (the server's
:func:`parse_batch` also needs msgspec, imported when first called).

A batch is one JSON object (optionally gzip-compressed on the wire)::

    {"v": 1, "agent_id": "node-017", "seq": 42, "host": "node-017", "sent_at": 1764464000.0,
     "topology": {"rack": "r12", "switch": "leaf-12"},
     "gpus": [...], "hosts": [...], "ports": [...], "events": [...], "steps": [...], "probes": [...],
     "runs": [...], "dropped": {"spool": 0}}

Records are declared below as classes whose annotations carry their constraints (``Annotated[float, Range(ge=0)]``).
From these declarations the module builds

* :func:`parse_batch` – decoding and validation of a batch's bytes in one pass, by msgspec types generated from the
  same declarations (:mod:`clusterdx.wire_compiled`); the server's ingest path;
* :func:`validate_batch` – a strict validator that returns plain dicts (defaults filled in) or raises
  :class:`WireError` naming the exact path (``gpus[3].power_w: expected a number, got "hot"``);
* :func:`json_schema` – JSON Schema components for the server's OpenAPI document.

Units live in field names (``_s``, ``_ms``, ``_bytes``, ``_w``, ``_mhz``, ``_pct``, ``_c``, ``_gbps``).
Unsupported or unknown measurements are ``null``, never a fake ``0``. Timestamps are Unix seconds (float).
Unknown fields are rejected so that a typo in a producer is an error, not a silent drop.

Identity and idempotency: the server accepts each (``agent_id``, ``seq``) once and answers a repeat as a duplicate.
A retry must resend the same JSON, byte for byte (gzip aside: the server hashes the decompressed body); the same
(``agent_id``, ``seq``) with *other* bytes is refused with 409 ``seq_reused`` (the producer's counter went back,
e.g. a spool rolled back by an OS crash): renumber that batch and send it again, never drop it. ``seq`` must
increase for the lifetime of an ``agent_id``; a producer that cannot persist its counter (a training process posting
directly) must use a fresh ``agent_id`` per process (``hook-<host>-<pid>-<start time>``).

Strings are Unicode text: a lone surrogate (``"\\ud800"``, which JSON can escape but UTF-8 cannot encode) and NUL are
refused, as every integer beyond the column that stores it: a batch the database cannot store must be a 400 the
producer drops, never a 5xx it would retry forever.

Time: the server bounds timestamps by its own clock. A batch whose ``sent_at`` or any record ``ts`` is more than
``CLUSTERDX_INGEST_MAX_FUTURE_S`` (default :data:`MAX_FUTURE_S`) ahead of the server, or whose ``sent_at`` is older
than the retention, is refused with 400 ``clock_skew``: a node a day ahead would otherwise look alive and busy in the
future, and its rows would escape retention.

The ingest endpoint: ``POST /api/v1/ingest`` with ``Authorization: Bearer <cluster token>``,
``Content-Type: application/json`` and optionally ``Content-Encoding: gzip``. Answers: 200
``{"status": "accepted" | "duplicate", "seq": N, "records": N, "send_interval_s": S}``, sent only after the batch's
commit; 4xx ``{"error": "<code>", "detail": "<reason>"}`` with 400 (bad JSON or schema; ``detail`` names the field;
``clock_skew``), 401 (missing, unknown or revoked token), 403 (token of another cluster), 409 (``seq_reused``:
renumber), 413 (body too large), 415 (not JSON / unknown encoding). Any other 4xx will never succeed on retry; 5xx and
429 may: 429 ``busy`` (the server's write queue is full) and 503 ``unavailable`` (its database is down) carry
``Retry-After`` (seconds) and mean the batch was not stored; keep it and send it again no sooner.

``send_interval_s`` (a float, in the 200 and the 429 ``busy`` answers) is the least number of seconds the server wants
between one agent's posts: 1 until a cluster has more nodes than the server's budget (``CLUSTERDX_INGEST_NODES_PER_S``),
then ``ceil(nodes / budget)``. Producers keep sampling at their own interval and put several samples in one batch.
"""

from __future__ import annotations

import json
import math
import operator
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

WIRE_VERSION = 1
# The server refuses larger bodies with 413; agents split batches below this (uncompressed JSON bytes).
MAX_BATCH_BYTES = 8 * 1024 * 1024
# Where the training hooks on a node drop their records for the local agent (UDP, JSON per datagram).
LOCAL_HOOK_ADDR = ("127.0.0.1", 8650)
MAX_DATAGRAM_BYTES = 60_000
# How far ahead of the receiver's clock a timestamp may be: the server's default (CLUSTERDX_INGEST_MAX_FUTURE_S), and
# the agent's bound on hook datagrams (same node, same clock): one forged record must not get a whole batch refused.
MAX_FUTURE_S = 300.0

# ---------------------------------------------------------------------------------------------------------------
# Constraint markers, used inside Annotated[...].


@dataclass(frozen=True, slots=True)
class Range:
    ge: float | None = None
    le: float | None = None


@dataclass(frozen=True, slots=True)
class Len:
    """Maximum length of a string, list or mapping (and minimum for strings)."""

    max: int
    min: int = 0


@dataclass(frozen=True, slots=True)
class Pattern:
    regex: str


@dataclass(frozen=True, slots=True)
class Doc:
    text: str


class MalformedJson(ValueError):
    """Bytes that are not JSON at all (the parser's own message); :class:`WireError` is JSON of the wrong shape."""


class WireError(ValueError):
    """A batch that does not match the wire format. ``path`` points at the offending value."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


# Reusable field types ---------------------------------------------------------------------------------------------
Unix = Annotated[float, Range(ge=0, le=1e11), Doc("Unix time in seconds")]
Seconds = Annotated[float, Range(ge=0, le=1e7)]
Pct = Annotated[float, Range(ge=0, le=100)]
Count = Annotated[int, Range(ge=0, le=2**63 - 1)]
# What a 32-bit signed column (IntegerField, PositiveIntegerField) holds; PostgreSQL refuses more ("integer out of
# range"), and a refused INSERT must be caught here as a 400, not become a 503 the agent retries forever.
Int32 = Annotated[int, Range(ge=0, le=2**31 - 1)]
Bytes = Annotated[int, Range(ge=0, le=2**63 - 1)]
Name = Annotated[str, Len(128, 1)]
Text = Annotated[str, Len(8192)]
Ident = Annotated[str, Len(128, 1), Pattern(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*")]
# Host names come from the machines themselves; RFC 1123 labels (and a few cloud oddities such as underscores).
Hostname = Annotated[str, Len(253, 1), Pattern(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")]
# Rack, switch and spine names as an inventory or Slurm's topology.conf writes them: host-name-like, short (the
# server keeps 64 characters).
FabricName = Annotated[str, Len(64, 1), Pattern(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")]
Severity = Literal["info", "warning", "error", "critical"]
Labels = Annotated[dict[str, Annotated[str, Len(1024)]], Len(64)]
# Every mapping's keys, whatever its declaration says.
DictKey = Annotated[str, Len(128, 1)]
Numbers = Annotated[dict[str, float], Len(64)]


class Record:
    """Base of every wire record: subclasses only declare annotated fields (with defaults for optional ones)."""


class GpuSample(Record):
    """One GPU at one instant (a wide row). ``None`` means the GPU or driver does not report it."""

    ts: Unix
    index: Annotated[int, Range(ge=0, le=1023)]
    uuid: Annotated[str, Len(96)] | None = None
    name: Annotated[str, Len(96)] | None = None
    pci_bus_id: Annotated[str, Len(32)] | None = None
    util_gpu_pct: Pct | None = None
    util_mem_pct: Pct | None = None
    mem_used_bytes: Bytes | None = None
    mem_total_bytes: Bytes | None = None
    temp_c: Annotated[float, Range(ge=-50, le=200)] | None = None
    power_w: Annotated[float, Range(ge=0, le=10000)] | None = None
    power_limit_w: Annotated[float, Range(ge=0, le=10000)] | None = None
    sm_clock_mhz: Annotated[float, Range(ge=0, le=10000)] | None = None
    sm_clock_max_mhz: Annotated[float, Range(ge=0, le=10000)] | None = None
    mem_clock_mhz: Annotated[float, Range(ge=0, le=20000)] | None = None
    mem_clock_max_mhz: Annotated[float, Range(ge=0, le=20000)] | None = None
    throttle_reasons: Annotated[list[Annotated[str, Len(64)]], Len(32)] | None = None
    ecc_sbe_volatile: Count | None = None
    ecc_dbe_volatile: Count | None = None
    ecc_sbe_aggregate: Count | None = None
    ecc_dbe_aggregate: Count | None = None
    retired_pages_sbe: Count | None = None
    retired_pages_dbe: Count | None = None
    retired_pages_pending: bool | None = None
    remap_correctable: Count | None = None
    remap_uncorrectable: Count | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay_total: Count | None = None
    pcie_gen: Annotated[int, Range(ge=0, le=16)] | None = None
    pcie_gen_max: Annotated[int, Range(ge=0, le=16)] | None = None
    pcie_width: Annotated[int, Range(ge=0, le=64)] | None = None
    pcie_width_max: Annotated[int, Range(ge=0, le=64)] | None = None
    nvlink_links_up: Annotated[int, Range(ge=0, le=64)] | None = None
    nvlink_links_total: Annotated[int, Range(ge=0, le=64)] | None = None
    nvlink_crc_errors_total: Count | None = None
    nvlink_replay_errors_total: Count | None = None
    nvlink_recovery_errors_total: Count | None = None
    # Why fields are None: {"ecc_sbe_volatile": "not supported"}; lets the dashboard say why a cell is empty.
    unavailable: Annotated[dict[str, Annotated[str, Len(128)]], Len(64)] | None = None


class NfsMount(Record):
    mount: Annotated[str, Len(1024, 1)]
    server: Annotated[str, Len(1024)] | None = None
    ops_per_s: Annotated[float, Range(ge=0)] | None = None
    rtt_ms: Annotated[float, Range(ge=0)] | None = None
    exe_ms: Annotated[float, Range(ge=0)] | None = None


# A Linux interface name as /sys/class/net lists it: at most 15 bytes (IFNAMSIZ - 1), no whitespace and no "/". Printable
# ASCII only: a name with control characters, NUL or a 10 KB run of text is no interface and is refused (400), where a
# page or a finding would otherwise print it.
IfName = Annotated[str, Len(15, 1), Pattern(r"[!-.0-~]+")]
# An address with its prefix length, as `ip addr` prints it: "10.0.0.7/24", "fe80::1/64" (no zone: the interface
# is the zone).
IfAddr = Annotated[str, Len(64, 1), Pattern(r"[0-9A-Fa-f.:]+(/[0-9]{1,3})?")]


class NetInterface(Record):
    """A network interface of the node (``/sys/class/net``): what NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME and the
    bootstrap choose from. ``state`` is the kernel's operstate (RFC 2863): loopback and many virtual devices say
    ``unknown`` while they carry traffic. ``virtual``: no device behind it (veth, bridge, bond, tunnel)."""

    name: IfName
    state: Literal["up", "down", "unknown", "dormant", "lowerlayerdown", "notpresent", "testing"] | None = None
    kind: Literal["ether", "infiniband", "loopback", "other"] | None = None  # from the ARP hardware type
    virtual: bool | None = None
    mtu: Annotated[int, Range(ge=0, le=1_000_000)] | None = None
    speed_mbps: Annotated[int, Range(ge=0, le=100_000_000)] | None = None  # null: not reported (virtual, link down)
    addresses: Annotated[list[IfAddr], Len(32)] = []


class HostSample(Record):
    ts: Unix
    cpu_pct: Pct | None = None
    load1: Annotated[float, Range(ge=0)] | None = None
    mem_used_bytes: Bytes | None = None
    mem_total_bytes: Bytes | None = None
    disk_read_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    disk_write_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    net_rx_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    net_tx_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    nfs: Annotated[list[NfsMount], Len(64)] | None = None
    # The node's network interfaces; agents send them when they change and every few minutes (null in between: the
    # server keeps the newest list it got).
    interfaces: Annotated[list[NetInterface], Len(512)] | None = None


class PortSample(Record):
    """An InfiniBand / RoCE port. ``counters`` are deltas over ``interval_s`` (wrap and saturation handled)."""

    ts: Unix
    device: Annotated[str, Len(64, 1)]
    port: Annotated[int, Range(ge=0, le=255)]
    state: Annotated[str, Len(32)] | None = None
    phys_state: Annotated[str, Len(32)] | None = None
    rate_gbps: Annotated[float, Range(ge=0, le=100000)] | None = None
    link_layer: Annotated[str, Len(32)] | None = None
    interval_s: Annotated[float, Range(ge=0, le=86400)] | None = None
    xmit_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    rcv_bytes_per_s: Annotated[float, Range(ge=0)] | None = None
    counters: Annotated[dict[str, Count], Len(128)] | None = None
    # Counters left out of ``counters`` and why: {"symbol_error": "saturated at 65535 (16-bit)..."}.
    unavailable: Annotated[dict[str, Annotated[str, Len(128)]], Len(128)] | None = None


EventKind = Literal["xid", "nccl", "kmsg", "error", "watchdog", "checkpoint", "agent", "hook"]
# The kinds a training process reports (trainer_hooks): all a hook datagram or a hook token may carry. The rest
# (an Xid, a kernel line) speak for the node and page the on-call; only its agent may send them.
HOOK_EVENT_KINDS = ("checkpoint", "error", "hook")


class Event(Record):
    """Something that happened: an Xid, an NCCL log line worth keeping, a watchdog timeout, a checkpoint."""

    ts: Unix
    kind: EventKind
    severity: Severity = "info"
    message: Text = ""
    code: Int32 | None = None
    gpu_index: Annotated[int, Range(ge=0, le=1023)] | None = None
    pci_bus_id: Annotated[str, Len(32)] | None = None
    run: Ident | None = None
    rank: Annotated[int, Range(ge=0, le=1_000_000)] | None = None
    step: Count | None = None
    data: Labels | None = None


GroupRole = Literal["dp", "tp", "pp", "cp", "ep", "world", "other"]


class GroupTiming(Record):
    """One process group's collectives during one step on one rank (trainer_hooks.collectives).

    Times are wall seconds on this rank. ``inflight_s`` is the union of the intervals during which at least one of
    the group's collectives was issued and not yet complete; ``exposed_s`` the part of it the training thread spent
    blocked on the group (a ``wait()``, or a synchronous collective), i.e. in flight and not overlapped with compute.
    ``arrive_s`` is when this rank issued the group's first collective of the step, from the step's start: the group's
    peers compare it to find the late rank of the group."""

    role: GroupRole  # from the DeviceMesh dimension name when there is one; "world" for the default group
    name: Annotated[str, Len(64)]  # the group's name or description ("dp", "mesh_tp", "0")
    group_rank: Annotated[int, Range(ge=0, le=1_000_000)]
    group_size: Annotated[int, Range(ge=1, le=1_000_000)]
    # Which group of its role this is (the DP replica index of a TP group, the stage pair of a PP link...): the
    # coordinate of this rank on the mesh's other dimensions, flattened; null when there is a single group.
    index: Annotated[int, Range(ge=0, le=1_000_000)] | None = None
    calls: Count
    bytes: Bytes | None = None
    inflight_s: Seconds
    exposed_s: Seconds | None = None
    arrive_s: Seconds | None = None
    ops: Annotated[dict[str, Count], Len(16)] | None = None  # calls by collective ("all_reduce": 12, "send": 4)


class Step(Record):
    """One training step on one rank, as the training hooks measured it."""

    run: Ident
    rank: Annotated[int, Range(ge=0, le=1_000_000)]
    step: Count
    ts: Unix  # when the step ended
    step_time_s: Seconds
    data_wait_s: Seconds | None = None
    compute_s: Seconds | None = None
    comm_s: Seconds | None = None
    # When this rank reached its first collective, relative to the step start: the late arriver is the culprit.
    comm_arrive_s: Seconds | None = None
    tokens: Count | None = None
    samples: Count | None = None
    phases: Annotated[dict[str, Seconds], Len(32)] | None = None
    metrics: Numbers | None = None
    mem_allocated_bytes: Bytes | None = None
    mem_reserved_bytes: Bytes | None = None
    mem_total_bytes: Bytes | None = None
    # Per process group (at most 16 per step). With groups, comm_s is the union of their exposed intervals plus the
    # time in flight of collectives whose wait no hook saw (DDP's reducer); compute_s is the body minus comm_s.
    groups: Annotated[list[GroupTiming], Len(16)] | None = None


class DataLoaderInfo(Record):
    batch_size: Count | None = None
    num_workers: Count | None = None
    pin_memory: bool | None = None
    prefetch_factor: Count | None = None
    persistent_workers: bool | None = None
    sampler: Annotated[str, Len(256)] | None = None
    dataset_path: Annotated[str, Len(4096)] | None = None


MeshSize = Annotated[int, Range(ge=1, le=1_000_000)]


class Layout(Record):
    """How a run is parallelized, as the training hooks found it (DeviceMesh, the Lightning strategy, accelerate)."""

    strategy: Annotated[str, Len(32)] | None = None  # ddp, fsdp, fsdp2, deepspeed, model_parallel, single...
    mesh: Annotated[dict[str, MeshSize], Len(8)] | None = None  # DeviceMesh dimension name -> size
    coords: Annotated[dict[str, Annotated[int, Range(ge=0, le=1_000_000)]], Len(8)] | None = None  # this rank's
    zero_stage: Annotated[int, Range(ge=0, le=3)] | None = None  # ZeRO stage (FSDP full shard counts as 3)
    offload: bool | None = None  # parameters or optimizer state offloaded to the CPU / NVMe
    activation_checkpointing: bool | None = None
    grad_accum: Annotated[int, Range(ge=1, le=1_000_000)] | None = None
    micro_batch: Annotated[int, Range(ge=1, le=100_000_000)] | None = None  # samples per micro-batch per rank
    sharding: Annotated[str, Len(32)] | None = None  # FSDP sharding strategy (FULL_SHARD, HYBRID_SHARD...)
    pp_schedule: Annotated[str, Len(64)] | None = None  # pipeline schedule class (ScheduleGPipe, Schedule1F1B...)
    pp_microbatches: Annotated[int, Range(ge=1, le=1_000_000)] | None = None


class RunMeta(Record):
    """A rank's view of its run, sent at start and whenever it changes."""

    run: Ident
    rank: Annotated[int, Range(ge=0, le=1_000_000)]
    world_size: Annotated[int, Range(ge=1, le=1_000_000)]
    ts: Unix
    local_rank: Annotated[int, Range(ge=0, le=1024)] | None = None
    host: Hostname | None = None
    gpu_index: Annotated[int, Range(ge=0, le=1023)] | None = None
    gpu_uuid: Annotated[str, Len(96)] | None = None
    gpu_name: Annotated[str, Len(96)] | None = None
    parallel: Annotated[dict[str, Annotated[int, Range(ge=1, le=1_000_000)]], Len(16)] | None = None
    versions: Annotated[dict[str, Annotated[str, Len(128)]], Len(16)] | None = None
    env: Labels | None = None
    dataloader: DataLoaderInfo | None = None
    params: Count | None = None
    flops_per_token: Annotated[float, Range(ge=0)] | None = None
    peak_flops: Annotated[float, Range(ge=0)] | None = None
    dtype: Annotated[str, Len(32)] | None = None
    last_checkpoint_step: Count | None = None
    last_checkpoint_ts: Unix | None = None
    layout: Layout | None = None


class Probe(Record):
    """A pairwise measurement from this agent's node to a peer (pingmesh-style)."""

    ts: Unix
    peer: Hostname
    sent: Int32
    lost: Int32
    rtt_ms: Annotated[float, Range(ge=0)] | None = None  # median of the round trips that came back
    rtt_p99_ms: Annotated[float, Range(ge=0)] | None = None
    bw_gbps: Annotated[float, Range(ge=0)] | None = None  # from a bulk transfer, when one ran


class RankBeat(Record):
    """A training process saying where it is, sent by the hooks' shipping thread about once a second — also while
    the training thread is blocked in a collective or a data fetch. Under DDP every rank stops stepping when one
    does; the beats tell which one: the dead or frozen rank goes silent, a stuck loader says ``data``."""

    run: Ident
    rank: Annotated[int, Range(ge=0, le=1_000_000)]
    ts: Unix
    # Where the training thread is: between steps, fetching a batch, inside a step's body (forward, backward and
    # the collectives), or done (the Monitor was closed cleanly / the process is dying of an exception).
    state: Literal["idle", "data", "step", "finished", "crashed"]
    state_s: Seconds  # for how long it has been in that state
    step: Count | None = None  # the last step that ended
    pid: Int32 | None = None  # a pid_t


class Topology(Record):
    """Where the node sits in the fabric: its rack, leaf switch and spine.

    From the agent's config or environment. Pages group nodes by it and the probe planner pairs peers by leaf; a
    field left out (null) means "not known here", never "no rack": the server keeps what it had."""

    rack: FabricName | None = None
    switch: FabricName | None = None  # the leaf switch the node's NICs are cabled to
    spine: FabricName | None = None


class Batch(Record):
    v: Literal[1]
    agent_id: Ident
    seq: Count
    host: Hostname
    sent_at: Unix
    # The cluster this producer believes it reports to; a token of another cluster is refused (403) instead of
    # silently mixing two clusters' data.
    cluster: Ident | None = None
    topology: Topology | None = None  # optional: agents that predate it, and hooks, send none
    gpus: Annotated[list[GpuSample], Len(4096)] = []
    hosts: Annotated[list[HostSample], Len(256)] = []
    ports: Annotated[list[PortSample], Len(1024)] = []
    events: Annotated[list[Event], Len(10000)] = []
    steps: Annotated[list[Step], Len(20000)] = []
    probes: Annotated[list[Probe], Len(4096)] = []
    runs: Annotated[list[RunMeta], Len(1024)] = []
    beats: Annotated[list[RankBeat], Len(4096)] = []
    # Records the producer had to drop (spool bound, hook queue full), by reason; reported, never hidden.
    dropped: Annotated[dict[str, Count], Len(16)] | None = None


class HookDatagram(Record):
    """What a training process sends to its node's agent over the local socket (one JSON object per datagram).

    The agent validates it and forwards the records in its next batch; ``dropped`` is the hook's own drop count
    (queue full, agent unreachable), cumulative since the process started."""

    v: Literal[1]
    host: Hostname
    pid: Int32
    steps: Annotated[list[Step], Len(1000)] = []
    runs: Annotated[list[RunMeta], Len(64)] = []
    events: Annotated[list[Event], Len(1000)] = []
    beats: Annotated[list[RankBeat], Len(64)] = []
    dropped: Annotated[dict[str, Count], Len(16)] | None = None


RECORDS: tuple[type[Record], ...] = (
    GpuSample, NfsMount, NetInterface, HostSample, PortSample, Event, GroupTiming, Step, DataLoaderInfo, Layout, RunMeta, Probe,
    RankBeat, Topology, Batch, HookDatagram,
)


# ---------------------------------------------------------------------------------------------------------------
# Compiling the declarations into validators.

Check = Callable[[Any, str], Any]
_MISSING = object()


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _bound(x: float) -> str:
    """A range bound as a producer can compare it: 2147483647, not 2.14748e+09."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _split_annotated(tp: Any) -> tuple[Any, list[Any]]:
    meta: list[Any] = []
    while typing.get_origin(tp) is Annotated:
        meta = list(tp.__metadata__) + meta
        tp = tp.__origin__
    return tp, meta


def _bounded(check: Check, meta: list[Any]) -> Check:
    rng = next((m for m in meta if isinstance(m, Range)), None)
    ln = next((m for m in meta if isinstance(m, Len)), None)
    pat = next((m for m in meta if isinstance(m, Pattern)), None)
    if rng is None and ln is None and pat is None:
        return check
    regex = re.compile(pat.regex) if pat else None

    def bounded(value: Any, path: str) -> Any:
        value = check(value, path)
        if rng is not None:
            if rng.ge is not None and value < rng.ge:
                raise WireError(path, f"must be >= {_bound(rng.ge)}, got {value!r}")
            if rng.le is not None and value > rng.le:
                raise WireError(path, f"must be <= {_bound(rng.le)}, got {value!r}")
        if ln is not None:
            if len(value) > ln.max:
                raise WireError(path, f"too long: {len(value)} > {ln.max}")
            if len(value) < ln.min:
                raise WireError(path, f"too short: must have at least {ln.min}")
        if regex is not None and not regex.fullmatch(value):
            raise WireError(path, f"{_describe(value)} does not match {pat.regex}")
        return value

    return bounded


def _check_str(value: Any, path: str) -> str:
    if type(value) is not str:
        raise WireError(path, f"expected a string, got {_describe(value)}")
    if "\x00" in value:
        raise WireError(path, "NUL characters are not allowed")  # PostgreSQL text and jsonb refuse them
    if not value.isascii():
        # JSON's "\ud800" escape decodes to a lone surrogate, which no UTF-8 database can store (SQLite raises
        # UnicodeEncodeError, PostgreSQL refuses it in jsonb). A proper pair ("\ud83d\ude00") decodes to one character.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = f"lone surrogate {value[exc.start]!r} at position {exc.start} is not Unicode text"
            raise WireError(path, bad) from None
    return value


def _check_bool(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise WireError(path, f"expected true or false, got {_describe(value)}")
    return value


def _check_int(value: Any, path: str) -> int:
    if type(value) is int:
        return value
    # 3.0 is accepted as 3: JSON encoders in other languages print integral floats that way.
    if type(value) is float and value.is_integer():
        return int(value)
    raise WireError(path, f"expected an integer, got {_describe(value)}")


def _check_float(value: Any, path: str) -> float:
    if type(value) is float:
        if not math.isfinite(value):
            raise WireError(path, "must be a finite number")
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:  # an integer of 309 digits or more is no float either
            raise WireError(path, "must be a finite number") from None
    raise WireError(path, f"expected a number, got {_describe(value)}")


_SCALARS: dict[Any, Check] = {str: _check_str, bool: _check_bool, int: _check_int, float: _check_float}


def _compile(tp: Any) -> Check:
    tp, meta = _split_annotated(tp)
    origin = typing.get_origin(tp)
    if tp in _SCALARS:
        return _bounded(_SCALARS[tp], meta)
    if origin is Literal:
        allowed = typing.get_args(tp)

        def literal(value: Any, path: str) -> Any:
            if value not in allowed or type(value) is bool:
                raise WireError(path, f"must be one of {', '.join(map(repr, allowed))}, got {_describe(value)}")
            return value

        return literal
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(tp)) != 2:
            raise TypeError(f"only 'T | None' unions are supported, got {tp}")
        inner = _compile(args[0])

        def optional(value: Any, path: str) -> Any:
            return None if value is None else inner(value, path)

        return _bounded(optional, meta) if meta else optional
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _compile(item_tp)

        def listed(value: Any, path: str) -> list[Any]:
            if type(value) is not list:
                raise WireError(path, f"expected a list, got {_describe(value)}")
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return _bounded(listed, meta)
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        key = _compile(DictKey)
        val = _compile(val_tp)

        def mapping(value: Any, path: str) -> dict[str, Any]:
            if type(value) is not dict:
                raise WireError(path, f"expected an object, got {_describe(value)}")
            return {key(k, path): val(v, f"{path}.{k}") for k, v in value.items()}

        return _bounded(mapping, meta)
    if isinstance(tp, type) and issubclass(tp, Record):
        return _record_check(tp)
    raise TypeError(f"unsupported wire type {tp!r}")


def _fields(cls: type[Record]) -> dict[str, tuple[Any, Any]]:
    """name -> (annotation, default or _MISSING), in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: (hints[name], getattr(cls, name, _MISSING)) for name in cls.__annotations__}


_CHECKS: dict[type[Record], Check] = {}


def _record_check(cls: type[Record]) -> Check:
    if cls in _CHECKS:
        return _CHECKS[cls]
    fields = _fields(cls)
    compiled = {name: (_compile(tp), default) for name, (tp, default) in fields.items()}
    required = [name for name, (_, default) in fields.items() if default is _MISSING]

    def record(value: Any, path: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise WireError(path, f"expected an object, got {_describe(value)}")
        unknown = value.keys() - compiled.keys()
        if unknown:
            name = sorted(unknown)[0]
            raise WireError(f"{path}.{name}" if path else name, f"unknown field (a {cls.__name__} has no such field)")
        out: dict[str, Any] = {}
        for name, (check, default) in compiled.items():
            sub = f"{path}.{name}" if path else name
            raw = value.get(name, _MISSING)
            if raw is _MISSING:
                if name in required:
                    raise WireError(sub, "missing required field")
                out[name] = list(default) if isinstance(default, list) else default
            else:
                out[name] = check(raw, sub)
        return out

    _CHECKS[cls] = record
    return record


def validate(cls: type[Record], value: Any, path: str = "") -> dict[str, Any]:
    """Validate one record of type ``cls``; returns a new dict with defaults filled in."""
    return _record_check(cls)(value, path)


def validate_batch(value: Any) -> dict[str, Any]:
    """Validate a decoded batch. Checks the version first so an agent from the future gets a precise error."""
    if type(value) is dict and "v" in value and value["v"] != WIRE_VERSION:
        raise WireError("v", f"unsupported wire version {value['v']!r}; this server speaks {WIRE_VERSION}")
    return validate(Batch, value)


# The record lists the server's ingest keeps as the compiled records (parse_batch's keep_records): the many, wide
# records of a node-second, which only the writer and the live publisher read.
KEPT_RECORDS = ("gpus", "steps", "probes")


def parse_batch(body: bytes, *, keep_records: bool = False) -> dict[str, Any]:
    """Decode and validate a batch's JSON bytes: what ``validate_batch(json.loads(body))`` returns, in a fraction of
    its time. Raises :class:`MalformedJson` for bytes that are not JSON and :class:`WireError` for a batch that is
    not of the wire format, with the reference path's exact message.

    The compiled path (:mod:`clusterdx.wire_compiled`, generated from the declarations above) accepts the batches
    producers send; it is never looser than the reference path, and anything it refuses or leaves alone goes to the
    reference path, which decides and words the error. Imported here, not at the top: agents and hooks use this module
    without msgspec.

    ``keep_records``: the GPU samples, steps and probes (:data:`KEPT_RECORDS`) may stay the compiled path's records
    (read by attribute, or by key like a dict), not dicts: what the server's ingest takes. Its readers take either
    kind (:class:`Fields`): the reference path, and producers in the server's process, give dicts."""
    from clusterdx import wire_compiled

    batch = wire_compiled.decode(Batch, body, KEPT_RECORDS if keep_records else ())
    if batch is not None:
        return batch
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8 or an integer of too many digits
        raise MalformedJson(str(exc)) from None
    try:
        return validate_batch(payload)
    except RecursionError:
        raise WireError("", "nesting too deep") from None


class Fields:
    """Reads ``names`` of a batch's records at C speed (operator's getters) whichever kind :func:`parse_batch` gave:
    dicts, or the compiled records it keeps with ``keep_records``. One name reads its bare value, several a tuple."""

    __slots__ = ("attr", "item", "names")

    def __init__(self, *names: str) -> None:
        self.item, self.attr = operator.itemgetter(*names), operator.attrgetter(*names)
        self.names = names

    def of(self, records: list[Any]) -> Callable[[Any], Any]:
        """The getter for the records of one list (a list holds one kind)."""
        return self.attr if records and type(records[0]) is not dict else self.item


def field_names(cls: type[Record]) -> tuple[str, ...]:
    return tuple(cls.__annotations__)


_TS_LISTS: dict[type[Record], tuple[str, ...]] = {}


def timestamps(cls: type[Record], value: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """``(path, seconds)`` of the ``sent_at`` and of every record ``ts`` in a validated batch or datagram ``value``:
    what a receiver bounds by its own clock (other times, such as ``last_checkpoint_ts``, may lie far back)."""
    lists = _TS_LISTS.get(cls)
    if lists is None:
        lists = _TS_LISTS[cls] = tuple(
            name for name, (tp, _) in _fields(cls).items()
            if typing.get_origin(inner := _split_annotated(tp)[0]) is list
            and "ts" in getattr(_split_annotated(typing.get_args(inner)[0])[0], "__annotations__", {}))
    if value.get("sent_at") is not None:
        yield "sent_at", value["sent_at"]
    for name in lists:
        for i, record in enumerate(value[name]):
            yield f"{name}[{i}].ts", record["ts"]


# ---------------------------------------------------------------------------------------------------------------
# JSON Schema, for the OpenAPI document.


def _schema(tp: Any) -> dict[str, Any]:
    tp, meta = _split_annotated(tp)
    origin = typing.get_origin(tp)
    out: dict[str, Any]
    if tp is str:
        out = {"type": "string"}
    elif tp is bool:
        out = {"type": "boolean"}
    elif tp is int:
        out = {"type": "integer"}
    elif tp is float:
        out = {"type": "number"}
    elif origin is Literal:
        out = {"enum": list(typing.get_args(tp))}
    elif origin is list:
        out = {"type": "array", "items": _schema(typing.get_args(tp)[0])}
    elif origin is dict:
        out = {"type": "object", "additionalProperties": _schema(typing.get_args(tp)[1])}
    elif isinstance(tp, type) and issubclass(tp, Record):
        out = {"$ref": f"#/components/schemas/{tp.__name__}"}
    else:  # T | None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        out = {"anyOf": [_schema(inner), {"type": "null"}]}
    for m in meta:
        if isinstance(m, Range):
            if m.ge is not None:
                out["minimum"] = m.ge
            if m.le is not None:
                out["maximum"] = m.le
        elif isinstance(m, Len):
            key = {"string": "Length", "array": "Items", "object": "Properties"}.get(out.get("type", ""), "")
            if key:
                out[f"max{key}"] = m.max
                if m.min:
                    out[f"min{key}"] = m.min
        elif isinstance(m, Pattern):
            out["pattern"] = f"^(?:{m.regex})$"
        elif isinstance(m, Doc):
            out["description"] = m.text
    return out


def json_schema() -> dict[str, dict[str, Any]]:
    """JSON Schema for every record, keyed by record name (OpenAPI ``components.schemas``)."""
    schemas: dict[str, dict[str, Any]] = {}
    for cls in RECORDS:
        fields = _fields(cls)
        props = {}
        for name, (tp, default) in fields.items():
            prop = _schema(tp)
            if default is not _MISSING:
                prop["default"] = default
            props[name] = prop
        schemas[cls.__name__] = {
            "type": "object",
            "description": (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else cls.__name__,
            "properties": props,
            "required": [n for n, (_, d) in fields.items() if d is _MISSING],
            "additionalProperties": False,
        }
    return schemas
