"""Collective timing at the process-group level, whatever issued it: DDP's comm hook, FSDP / FSDP2, DTensor (tensor
parallel), ``torch.distributed.pipelining``, DeepSpeed on torch.distributed, or a hand-written ``dist.all_reduce``.

Why wrapping, and where. torch offers no per-collective callback for every backend: the c10d flight recorder keeps
only enqueue times on gloo (no completion) and must be dumped as a pickle with stack frames; the on-completion hook
is NCCL only. Every eager collective does pass through one of two Python-visible doors, though:

* the ``ProcessGroup`` methods (``allreduce``, ``all_gather_single``, ``reduce_scatter_single``, ``send``...), which
  every ``torch.distributed`` function calls (FSDP, DDP's Python comm hook, pipelining's P2P, DeepSpeed);
* the functional collectives ``torch.ops._c10d_functional.*`` that DTensor uses, completed by ``wait_tensor``.

:func:`install` wraps both (and ``Work.wait``) once per process. Outside a measured step a wrapper is one global read
and a call through; inside, it takes a clock mark before the call, keeps the ``Work`` (or the functional result),
and marks the completion when it is known:

* in flight: from the issue to the completion, by the work's future (gloo runs the callback on its thread when the
  collective finished; NCCL's callback records a CUDA event on a stream that waits for it), else by the end of the
  ``wait`` that returned it (gloo's send/recv have no future; functional collectives complete in ``wait_tensor``);
* exposed: the time the training thread was held by the group: the length of each ``wait`` on the host; on CUDA,
  where ``wait`` only makes the current stream wait, from an event recorded on the current stream at the wait to the
  collective's completion (when the compute stream got there first). A collective no Python code waited for (DDP's
  reducer waits in C++) has no measured exposure: its group's ``exposed_s`` is null and the step's ``comm_s``
  counts its whole time in flight instead (the conservative choice, and what the DDP comm hook reported before).

The wrappers never touch a tensor: they call the original with the same arguments and return what it returned,
so the numerics are those of the run without them (tests/hooks check parameters bitwise).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from trainer_hooks.timing import union_length

# ProcessGroup methods and the canonical name each is counted under (GroupTiming.ops).
PG_OPS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single": "all_gather", "all_gather_single_coalesced": "all_gather", "_allgather_base": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
    "scatter": "scatter", "send": "send", "recv": "recv", "recv_anysource": "recv", "barrier": "barrier",
}
FUNCOL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
P2P = frozenset({"send", "recv"})
# DeviceMesh dimension names as torchtitan, Lightning and accelerate spell them -> the wire's role.
_ROLES = {
    "dp": "dp", "ddp": "dp", "fsdp": "dp", "hsdp": "dp", "dp_replicate": "dp", "dp_shard": "dp", "dp_shard_cp": "dp",
    "dp_cp": "dp", "replicate": "dp", "shard": "dp", "data": "dp", "tp": "tp", "tensor": "tp", "pp": "pp",
    "pipe": "pp", "pipeline": "pp", "cp": "cp", "context": "cp", "ep": "ep", "expert": "ep", "world": "world",
}
_PENDING_MAX = 4096  # works kept for a wait that may never come (an isend nobody waits for): bounded


def role_of(dim_name: str) -> str:
    return _ROLES.get(dim_name.lower(), "other")


class GroupInfo:
    """What a GroupTiming says about its group, resolved once per group."""

    __slots__ = ("group_rank", "group_size", "index", "name", "role")

    def __init__(self, role: str, name: str, group_rank: int, group_size: int, index: int | None) -> None:
        self.role, self.name, self.group_rank, self.group_size, self.index = role, name[:64], group_rank, group_size, index

    def key(self) -> tuple[str, str, int | None]:
        return self.role, self.name, self.index


class Call:
    """One collective issued during a step. ``end`` and ``waits`` may be filled from another thread (gloo's)."""

    __slots__ = ("end", "group", "handle", "nbytes", "op", "start", "waits")

    def __init__(self, group: GroupInfo, op: str, nbytes: int | None, start: Any, handle: Any) -> None:
        self.group, self.op, self.nbytes, self.start, self.handle = group, op, nbytes, start, handle
        self.end: Any = None
        self.waits: list[tuple[Any, Any]] = []  # (start mark, end mark or None: "until the collective completed")


class Tracer:
    """The process's collective tracer: the wrappers report to the step timer set as ``timer`` (one per process)."""

    def __init__(self) -> None:
        self.timer: Any = None  # a StepTimer; its ``_calls`` collects the open step's collectives
        self.meshes: list[Any] = []
        self._groups: dict[tuple[int, bool], GroupInfo] = {}
        self._named: dict[tuple[str, bool], GroupInfo] = {}
        self._pending: dict[int, Call] = {}
        self._no_future: set[str] = set()
        self._roles: dict[int, str] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def attach(self, timer: Any) -> None:
        """Report to ``timer`` from now on (a Monitor's first step). Groups are resolved anew: a process group
        destroyed since may have left its id to a new one."""
        self._groups.clear()
        self._named.clear()
        self._pending.clear()
        self.timer = timer

    # -- what a group is --------------------------------------------------------------------------------------------
    def watch_mesh(self, mesh: Any) -> None:
        """A DeviceMesh whose dimension names give its groups' roles (found on DTensor parameters, or given)."""
        root = _root_mesh(mesh)
        if root is not None and all(root is not m for m in self.meshes):
            self.meshes.append(root)
            self._groups.clear()
            self._named.clear()

    def set_role(self, pg: Any, role: str) -> None:
        """The role of a group no mesh names (DDP's process group is its data-parallel group)."""
        if pg is not None:
            self._roles[id(pg)] = role
            self._groups.clear()
            self._named.clear()

    def group(self, pg: Any, p2p: bool) -> GroupInfo:
        info = self._groups.get((id(pg), p2p))
        if info is None:
            info = self._groups[(id(pg), p2p)] = self._resolve(pg, p2p)
        return info

    def group_named(self, name: str, p2p: bool = False) -> GroupInfo:
        info = self._named.get((name, p2p))
        if info is None:
            from torch._C._distributed_c10d import _resolve_process_group

            info = self._named[(name, p2p)] = self.group(_resolve_process_group(name), p2p)
        return info

    def _resolve(self, pg: Any, p2p: bool) -> GroupInfo:
        dist = sys.modules["torch.distributed"]
        rank, size = pg.rank(), pg.size()
        for mesh in self.meshes:
            for dim, dim_name in enumerate(mesh.mesh_dim_names or ()):
                try:
                    same = mesh.get_group(dim).group_name == pg.group_name
                except Exception:  # a dimension of another process's sub-mesh
                    continue
                if same:
                    return GroupInfo(role_of(dim_name), dim_name, rank, size, _row_index(mesh, dim, dist.get_rank()))
        desc = str(getattr(pg, "group_desc", "") or pg.group_name)
        if id(pg) in self._roles:
            role = self._roles[id(pg)]
        elif desc.startswith("mesh_"):
            role = role_of(desc[5:])
        else:
            role = "world" if pg is dist.group.WORLD or desc == "default_pg" else "other"
        if p2p and role in ("world", "other"):
            role = "pp"  # point-to-point between ranks of a role-less group: a pipeline's activations
        return GroupInfo(role, desc, rank, size, None)

    # -- the wrappers' work -----------------------------------------------------------------------------------------
    def issued(self, timer: Any, info: GroupInfo, op: str, args: tuple[Any, ...], start: Any, result: Any,
               keys: list[Any]) -> None:
        """``keys``: what a later wait will be called on, by identity (a Work) or by storage (ints: a functional
        collective's result is often waited on through a view of it)."""
        call = Call(info, op, _nbytes(args), start, result)
        timer._calls.append(call)
        pending = self._pending
        if len(pending) > _PENDING_MAX:
            pending.clear()
        for key in keys:
            pending[key if type(key) is int else id(key)] = call
        if result is None or not hasattr(result, "get_future") or op in self._no_future:
            return
        try:
            future = result.get_future()
        except RuntimeError:  # gloo's send/recv: no future; completion is the end of their wait
            self._no_future.add(op)
            return
        clock = timer.clock

        def completed(_fut: Any) -> None:
            call.end = clock.mark()

        future.then(completed)

    def waiting(self, handle: Any) -> Call | None:
        return self._pending.pop(id(handle), None) if self._pending else None

    def waiting_tensor(self, tensor: Any) -> Call | None:
        return self._pending.pop(_storage(tensor), None) if self._pending else None

    def waited(self, call: Call, clock: Any, start: Any) -> None:
        if clock.deferred:
            call.waits.append((start, None))
        else:
            end = clock.mark()
            call.waits.append((start, end))
            if call.end is None:
                call.end = end

    # -- installing -------------------------------------------------------------------------------------------------
    def install(self) -> bool:
        """Wraps the ProcessGroup methods, ``Work.wait`` and the functional collectives; False without torch.distributed."""
        with self._lock:
            if self._saved:
                return True
            try:
                import torch
                from torch._C._distributed_c10d import ProcessGroup, Work
            except ImportError:
                return False
            for name, op in PG_OPS.items():
                original = getattr(ProcessGroup, name, None)
                if original is not None:
                    self._patch(ProcessGroup, name, _pg_wrapper(self, original, op, op in P2P))
            self._patch(Work, "wait", _wait_wrapper(self, Work.wait))
            namespace = torch.ops._c10d_functional
            for name, op in FUNCOL_OPS.items():
                try:
                    original = getattr(namespace, name)
                except (AttributeError, RuntimeError):
                    continue
                self._patch(namespace, name, _FuncolOp(self, original, op))
            with contextlib.suppress(AttributeError, RuntimeError):
                self._patch(namespace, "wait_tensor", _FuncolWait(self, namespace.wait_tensor))
            return True

    def uninstall(self) -> None:
        with self._lock:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()
            self._pending.clear()

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        # The class's own entry, not getattr's: a pybind method read through getattr is a plain builtin that would
        # no longer bind ``self`` once set back.
        original = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)


TRACER = Tracer()


def _pg_wrapper(tracer: Tracer, original: Any, op: str, p2p: bool) -> Any:
    def traced(pg: Any, *args: Any, **kwargs: Any) -> Any:
        timer = tracer.timer
        if timer is None or not timer._open:
            return original(pg, *args, **kwargs)
        info = tracer.group(pg, p2p)
        start = timer.clock.mark()
        work = original(pg, *args, **kwargs)
        tracer.issued(timer, info, op, args, start, work, [work] if work is not None else [])
        return work

    traced.__name__ = traced.__qualname__ = getattr(original, "__name__", op)
    traced.__doc__ = getattr(original, "__doc__", None)
    return traced


def _wait_wrapper(tracer: Tracer, original: Any) -> Any:
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        call = tracer.waiting(work)
        if call is None:
            return original(work, *args, **kwargs)
        clock = tracer.timer.clock if tracer.timer is not None else None
        if clock is None:
            return original(work, *args, **kwargs)
        start = clock.mark()
        out = original(work, *args, **kwargs)
        tracer.waited(call, clock, start)
        return out

    wait.__doc__ = getattr(original, "__doc__", None)
    return wait


class _FuncolOp:
    """A functional collective (``torch.ops._c10d_functional.all_reduce`` ...): still an OpOverloadPacket to whoever
    reads its attributes (``.default``), a timed call to whoever calls it."""

    def __init__(self, tracer: Tracer, original: Any, op: str) -> None:
        self._tracer, self._original, self._op = tracer, original, op

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = self._tracer
        timer = tracer.timer
        if timer is None or not timer._open:
            return self._original(*args, **kwargs)
        group_name = kwargs.get("group_name", args[-1] if args else None)
        start = timer.clock.mark()
        out = self._original(*args, **kwargs)
        if isinstance(group_name, str):
            results = list(out) if isinstance(out, list | tuple) else [out]
            keys = [_storage(t) for t in results]
            tracer.issued(timer, tracer.group_named(group_name), self._op, args, start, None, keys)
        return out


class _FuncolWait:
    def __init__(self, tracer: Tracer, original: Any) -> None:
        self._tracer, self._original = tracer, original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)

    def __call__(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        tracer = self._tracer
        call = tracer.waiting_tensor(tensor)
        if call is None or tracer.timer is None:
            return self._original(tensor, *args, **kwargs)
        clock = tracer.timer.clock
        start = clock.mark()
        out = self._original(tensor, *args, **kwargs)
        tracer.waited(call, clock, start)
        return out


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (AttributeError, RuntimeError):  # a subclass without storage: by identity then
        return id(tensor)


def _nbytes(args: tuple[Any, ...]) -> int | None:
    """The larger of the first two tensor arguments (input or output, lists summed): an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer."""
    best: int | None = None
    for arg in args[:2]:
        tensors = arg if isinstance(arg, list | tuple) else (arg,)
        total = 0
        for t in tensors:
            if isinstance(t, list | tuple):  # allgather's list of lists
                total += sum(x.nbytes for x in t if hasattr(x, "nbytes"))
            elif hasattr(t, "nbytes"):
                total += t.nbytes
        if total and (best is None or total > best):
            best = total
    return best


def _root_mesh(mesh: Any) -> Any:
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        try:
            return getter()
        except Exception:
            return mesh
    return mesh


def _row_index(mesh: Any, dim: int, global_rank: int) -> int | None:
    """Which group of dimension ``dim`` holds this rank: the row of the mesh with ``dim`` moved last (the same order
    on every rank), so that the TP groups of two DP replicas are told apart. None when there is only one."""
    grid = mesh.mesh
    rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
    if rows.shape[0] <= 1:
        return None
    hits = (rows == global_rank).any(dim=1).nonzero()
    return int(hits[0, 0]) if len(hits) else None


# -- turning a step's calls into GroupTiming dicts ---------------------------------------------------------------------

def summarize(calls: list[Call], seconds: Any, begin: Any, body: float, lead: float,
              extra: list[tuple[float, float]]) -> tuple[list[dict[str, Any]], float, float | None]:
    """(GroupTiming dicts, the step's comm_s, comm_arrive_s) from a step's calls (``extra``: spans timed by hand or
    by the DDP comm hook, in seconds from the body's begin)."""
    groups: dict[tuple[str, str, int | None], dict[str, Any]] = {}
    spans: dict[tuple[str, str, int | None], list[tuple[float, float]]] = {}
    exposed: dict[tuple[str, str, int | None], list[tuple[float, float]] | None] = {}
    held: list[tuple[float, float]] = list(extra)
    first = min((a for a, _ in extra), default=None)
    for call in calls:
        info = call.group
        key = info.key()
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"role": info.role, "name": info.name, "group_rank": info.group_rank,
                               "group_size": info.group_size, "index": info.index, "calls": 0, "bytes": None,
                               "inflight_s": 0.0, "exposed_s": None, "arrive_s": None, "ops": {}}
            spans[key], exposed[key] = [], []
        g["calls"] += 1
        g["ops"][call.op] = g["ops"].get(call.op, 0) + 1
        if call.nbytes is not None:
            g["bytes"] = (g["bytes"] or 0) + call.nbytes
        start = _clip(seconds(begin, call.start), body)
        end = _clip(seconds(begin, call.end), body) if call.end is not None else body
        end = max(start, end)
        spans[key].append((start, end))
        g["arrive_s"] = start if g["arrive_s"] is None else min(g["arrive_s"], start)
        first = start if first is None else min(first, start)
        waits = list(call.waits)
        if not waits:
            exposed[key] = None  # nobody in Python waited: count it all, say nothing of its exposure
            held.append((start, end))
            continue
        for a, b in waits:
            wa = _clip(seconds(begin, a), body)
            wb = _clip(seconds(begin, b), body) if b is not None else end
            if wb > wa:
                held.append((wa, wb))
                if exposed[key] is not None:
                    exposed[key].append((wa, wb))  # type: ignore[union-attr]
    out = []
    for key, g in list(groups.items())[:16]:  # the wire's bound; a step with more groups is unusual
        g["inflight_s"] = union_length(spans[key])
        e = exposed[key]
        g["exposed_s"] = union_length(e) if e is not None else None
        g["arrive_s"] = max(0.0, lead + g["arrive_s"])
        g["ops"] = dict(list(g["ops"].items())[:16])
        out.append(g)
    arrive = max(0.0, lead + first) if first is not None else None
    return out, union_length([(max(0.0, a), min(body, b)) for a, b in held if b > a]), arrive


def _clip(x: float, body: float) -> float:
    return 0.0 if x < 0 else body if x > body else x
