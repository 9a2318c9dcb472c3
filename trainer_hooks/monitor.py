"""``Monitor``: two lines in a plain PyTorch loop, and what the Lightning and HF adapters drive.

    mon = Monitor(run="llama-8b", model=model)
    for batch in mon.loader(dataloader):          # the wait for each batch
        with mon.step(tokens=batch.numel()):       # the step: compute, communication, phases
            ...
            mon.log(loss=loss)

Everything the training thread calls is a few attribute updates and clock reads; records are built from them and
queued for the :class:`~trainer_hooks.transport.Shipper`. No method raises because of measuring or shipping.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from trainer_hooks import layout as layouts
from trainer_hooks import meta
from trainer_hooks.collectives import TRACER
from trainer_hooks.timing import CudaClock, FinishedStep, StepTimer, perf_counter
from trainer_hooks.transport import Config, Shipper

_META_EVERY_S = 300.0  # re-send the run metadata this often even unchanged: an agent or server may have restarted
_META_RETRY_S = 5.0  # ... and this soon after one was dropped (no agent yet, the server away): see Shipper.meta_lost
_MEM_EVERY_S = 1.0  # torch's allocator statistics cost tens of µs; once a second is enough for memory pressure


class Monitor:
    """Measures each training step of this rank and ships it; see the module docstring for the two-line use.

    ``run`` names the run (every rank must agree): given, or ``$CLUSTERDX_RUN``, or the Slurm / torchrun job id.
    ``model`` gives the parameter count; ``flops_per_token`` defaults to 6·N. ``dtype`` picks the GPU peak the
    server computes MFU against (``"bf16"`` on CUDA unless told). ``parallel`` holds the parallelism sizes
    (``{"tp": 8, "pp": 4}``; ``dp`` defaults to world size / (tp·pp·cp·ep)). ``device="cpu"`` forces host
    timing.
    ``transport``: ``auto`` (agent, else server), ``agent``, ``server`` or ``off``; the other transport settings
    come from the ``CLUSTERDX_*`` environment (see docs/training-hooks.md).
    ``collectives`` (default on) times every collective by process group (:mod:`trainer_hooks.collectives`);
    ``mesh``: the DeviceMesh whose dimension names give the groups' roles (found on DTensor parameters otherwise);
    ``layout``: Layout fields to state by hand (``{"grad_accum": 4}``)."""

    def __init__(self, run: str | None = None, *, model: Any = None, params: int | None = None,
                 flops_per_token: float | None = None, dtype: Any = None, parallel: dict[str, int] | None = None,
                 device: Any = None, transport: str | None = None, queue_size: int | None = None,
                 interval: float | None = None, start_step: int = 0, server: str | None = None,
                 token: str | None = None, collectives: bool = True, mesh: Any = None,
                 layout: dict[str, Any] | None = None) -> None:
        self.host = meta.hostname()
        self._ident = meta.identity()
        named = run or meta.default_run_name()
        self.run = meta.ident(named) if named else meta.ident(f"local-{self.host}-{os.getpid()}")
        config = Config.from_env(mode=transport, queue_size=queue_size, interval=interval, server=server,
                                 token=token)
        self.shipper = Shipper(self.host, config)
        if named is None:
            self.shipper.warn_once("run", "clusterdx hooks: no run name (Monitor(run=...) or CLUSTERDX_RUN); "
                                          f"ranks will not be grouped; using {self.run}")
        self.timer = StepTimer(self.run, self._ident.rank, self._emit_step)
        self.timer.step = start_step
        self.timer.on_nonfinite = self._nonfinite
        self.shipper.before_close = self._drain
        self.shipper.beat = self._beat
        self._crashed: str | None = None
        _watch_for_crash(self)
        self._device_choice = device
        self._device: Any = None  # the torch CUDA device once chosen; None means host timing
        self._started = False
        self._dist_seen = self._ident.source == "torch.distributed"
        self._static: dict[str, Any] = {"versions": meta.versions(), "env": meta.relevant_env()}
        self._meta_parts: dict[str, Any] = {"dtype": meta.dtype_name(dtype), "parallel": dict(parallel or {}),
                                            "layout": layouts.clean(layout or {})}
        self._collectives = collectives
        self._params, self._flops_per_token = params, flops_per_token
        self._last_meta: dict[str, Any] | None = None
        self._meta_dirty = True
        self._meta_due = 0.0
        self._warned_metrics: set[str] = set()
        self._step_ctx = _StepContext(self)
        self._phases: dict[str, _Phase] = {}
        self._comm_ctx = _Comm(self.timer)
        if mesh is not None:
            self.watch_mesh(mesh)
        if model is not None:
            self.watch(model)

    # -- the loop --------------------------------------------------------------------------------------------------
    def loader(self, iterable: Iterable[Any]) -> _TimedLoader:
        """Wraps a DataLoader (or any iterable): the time spent waiting for each batch is the step's data wait."""
        self.watch_loader(iterable)
        return _TimedLoader(iterable, self.timer)

    def step(self, step: int | None = None, tokens: int | None = None, samples: int | None = None) -> _StepContext:
        """``with mon.step(...)``: one training step. ``step`` defaults to a counter from ``start_step``."""
        ctx = self._step_ctx
        ctx.args = (step, tokens, samples)
        return ctx

    def begin_step(self, step: int | None = None, tokens: int | None = None, samples: int | None = None) -> None:
        if not self._started:
            self._start()
        elif not self._dist_seen and meta.dist_initialized():  # init_process_group after Monitor(): new rank
            self._refresh_identity()
        self.timer.begin(step, tokens, samples)

    def end_step(self, tokens: int | None = None, samples: int | None = None) -> None:
        timer = self.timer
        if tokens is not None or samples is not None:
            timer.count(tokens, samples)
        timer.end()
        if self.shipper.meta_lost:
            self._meta_lost()
        if self._meta_dirty or timer._begin_host > self._meta_due:
            self._send_meta()

    def phase(self, name: str) -> _Phase:
        """``with mon.phase("forward")``: time a part of the step (reported in the step's ``phases``)."""
        ctx = self._phases.get(name)
        if ctx is None:
            ctx = self._phases[name] = _Phase(self.timer, name[:128])
        return ctx

    def comm(self) -> _Comm:
        """``with mon.comm()``: around a hand-written collective, counted in ``comm_s`` like DDP's all-reduces."""
        return self._comm_ctx

    def log(self, **values: Any) -> None:
        """Loss, grad norm, learning rate...: attached to the open step, or between steps to the one that ended.

        Tensors are fine: a CUDA tensor is copied to the host without blocking and read once its step's events
        are done, so logging a loss adds no synchronize."""
        deferred = self.timer.clock.deferred
        copies = False
        for key, value in values.items():
            if hasattr(value, "detach"):
                values[key] = _host_scalar(value, deferred)
                copies = copies or hasattr(values[key], "detach")
        self.timer.log(values, device_copies=copies)

    def checkpoint_saved(self, step: int | None = None, path: str | None = None) -> None:
        step = self.timer.step if step is None else step
        now = time.time()
        self._meta_parts.update(last_checkpoint_step=step, last_checkpoint_ts=now)
        event: dict[str, Any] = {"ts": now, "kind": "checkpoint", "message": f"checkpoint saved at step {step}",
                                 "run": self.run, "rank": self._ident.rank, "step": step}
        if path:
            event["data"] = {"path": os.fspath(path)[:1024]}
        self.shipper.put("events", event)
        self._send_meta()  # now, not at the next step's end: the last checkpoint often comes after the last step

    # -- what the run is -------------------------------------------------------------------------------------------
    def watch(self, model: Any) -> None:
        """The model: its parameter count (and 6·N FLOPs per token unless given), its layout (wrappers, DeviceMesh,
        activation checkpointing)."""
        if self._params is None:
            self._params = meta.count_params(model)
            self._meta_dirty = True
        try:
            found = layouts.from_model(model)
            meshes = layouts.meshes_of(model)
        except Exception as exc:  # the layout is nice to have; an odd model must not cost the steps
            self.shipper.warn_once("layout", f"clusterdx hooks: layout unavailable: {exc!r}")
            return
        for mesh in meshes:
            self.watch_mesh(mesh)
        self.set_layout(**{k: v for k, v in found.items() if self._meta_parts["layout"].get(k) is None})

    def watch_mesh(self, mesh: Any) -> None:
        """A DeviceMesh: its dimensions and this rank's coordinates go into the layout, and its dimension names give
        the roles (dp / tp / pp / cp / ep) of the collectives' groups."""
        TRACER.watch_mesh(mesh)
        root = TRACER.meshes[-1] if TRACER.meshes else mesh
        self.set_layout(**layouts.from_mesh(root))
        sizes = layouts.parallel_sizes(root)
        if sizes:
            self.set_parallel(**{k: v for k, v in sizes.items() if k not in self._meta_parts["parallel"]})

    def watch_pipeline(self, schedule: Any) -> None:
        """A ``torch.distributed.pipelining`` schedule: its kind and micro-batch count go into the layout."""
        found = layouts.from_schedule(schedule)
        if self._meta_parts["layout"].get("strategy") is not None:  # FSDP or TP inside each stage says more
            del found["strategy"]
        self.set_layout(**found)

    def set_layout(self, **fields: Any) -> None:
        """Layout fields known to the caller (``strategy="deepspeed", zero_stage=2, grad_accum=8``)."""
        current = self._meta_parts["layout"]
        update = layouts.clean(fields)
        if any(current.get(k) != v for k, v in update.items()):
            current.update(update)
            self._meta_dirty = True

    def watch_loader(self, loader: Any) -> None:
        info = meta.dataloader_info(loader)
        if info is not None:
            self._meta_parts["dataloader"] = info
            self._meta_dirty = True

    def set_identity(self, rank: int, world_size: int, local_rank: int | None = None) -> None:
        """For frameworks that know better than the environment (Lightning, HF)."""
        self._ident = meta.Identity(rank, world_size, local_rank, "framework")
        self._dist_seen = True
        self.timer.rank = rank
        self._meta_dirty = True

    def set_dtype(self, dtype: Any) -> None:
        """The framework's precision, unless the user named a dtype."""
        if self._meta_parts["dtype"] is None and meta.dtype_name(dtype) is not None:
            self._meta_parts["dtype"] = meta.dtype_name(dtype)
            self._meta_dirty = True

    def set_parallel(self, **sizes: int) -> None:
        self._meta_parts["parallel"].update({k: int(v) for k, v in sizes.items() if v})
        self._meta_dirty = True

    def ddp_comm_hook(self, ddp_model: Any, hook: Any = None, state: Any = None) -> None:
        """Time DDP's gradient all-reduces (``hook``/``state``: a hook of yours to wrap; default: torch's)."""
        from trainer_hooks.ddp import register_comm_hook

        register_comm_hook(ddp_model, self.timer, hook=hook, state=state)
        TRACER.set_role(getattr(ddp_model, "process_group", None), "dp")
        if self._meta_parts["layout"].get("strategy") is None:
            self.set_layout(strategy="ddp", zero_stage=0)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Drops by reason, what was sent, and steps shipped without GPU timings (their events were late)."""
        return {"dropped": dict(self.shipper.dropped), "sent": dict(self.shipper.sent), "late": self.timer.late,
                "transport": self.shipper.config.mode}

    def flush(self, timeout: float = 2.0) -> bool:
        """Ships the steps held for late metrics (those whose GPU events are done) and everything queued."""
        self.timer.poll()
        return self.shipper.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Ships pending steps (waiting for their GPU events: training is over) and what is queued.

        Runs by itself at interpreter exit; call it earlier to bound when the last records leave."""
        self.shipper.close(timeout)

    def _drain(self) -> None:
        if TRACER.timer is self.timer:
            TRACER.timer = None
        self.timer.poll(force=True)
        if self._started:  # a run that ends cleanly stops stepping too: tell the server it is not a hang
            state = "crashed" if self._crashed else "finished"
            self.shipper.put("events", {
                "ts": time.time(), "kind": "hook", "severity": "error" if self._crashed else "info", "run": self.run,
                "rank": self._ident.rank, "step": self.timer.last_step, "message": f"rank {self._ident.rank} {state}",
                "data": {"state": state},
            })

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        self._refresh_identity()
        if self._collectives and "torch" in sys.modules and TRACER.install():
            TRACER.attach(self.timer)  # one Monitor per process measures; the last one started wins
        self._device = _cuda_device(self._device_choice)
        if self._device is not None:
            torch = sys.modules["torch"]
            device = self._device
            self.timer.clock = CudaClock(lambda: torch.cuda.Event(enable_timing=True))
            self._meta_parts.update(meta.gpu_info(device))
            total = self._meta_parts.pop("mem_total_bytes")
            self.timer.set_memory_probe(_MemoryProbe(torch, device, total))
            if self._meta_parts["dtype"] is None:
                self._meta_parts["dtype"] = "bf16"
        self._send_meta()

    def _refresh_identity(self) -> None:
        current = meta.identity()
        if current.source == "torch.distributed":
            self._dist_seen = True
        if (current.rank, current.world_size) != (self._ident.rank, self._ident.world_size):
            self._ident = current
            self.timer.rank = current.rank
            self._meta_dirty = True

    def _beat(self) -> dict[str, Any] | None:
        """Called by the shipping thread about once a second, also while training is blocked in a collective."""
        if not self._started:
            return None
        state, seconds = self.timer.where()
        if self.shipper.closing:
            state, seconds = ("crashed" if self._crashed else "finished"), 0.0
        beat: dict[str, Any] = {"run": self.run, "rank": self._ident.rank, "ts": time.time(), "state": state,
                                "state_s": min(seconds, 1e7), "pid": os.getpid()}
        if self.timer.last_step is not None:
            beat["step"] = self.timer.last_step
        return beat

    def _crash(self, exc: BaseException) -> None:
        """The process is dying of ``exc``: say so (gloo and NCCL name the peer that vanished) before exit."""
        text = f"{type(exc).__name__}: {exc}"
        self._crashed = text
        self.shipper.put("events", {
            "ts": time.time(), "kind": "error", "severity": "error", "run": self.run, "rank": self._ident.rank,
            "step": self.timer.last_step, "message": text[:8000], "data": {"exception": type(exc).__name__[:1000]},
        })

    def _emit_step(self, step: FinishedStep) -> None:
        self.shipper.put("steps", step)

    def _nonfinite(self, step: int, key: str) -> None:
        if key in self._warned_metrics:
            return
        self._warned_metrics.add(key)
        self.shipper.put("events", {
            "ts": time.time(), "kind": "hook", "severity": "warning", "run": self.run, "rank": self._ident.rank,
            "step": step, "message": f"{key[:128]} is not a finite number (first seen at step {step})",
        })

    def _meta_lost(self) -> None:
        """The last metadata sent never left this process: sent again within ``_META_RETRY_S`` (not at once: while
        the agent is away each try is dropped too), even unchanged."""
        self.shipper.meta_lost = False
        self._last_meta = None
        self._meta_due = min(self._meta_due, perf_counter() + _META_RETRY_S)

    def _send_meta(self) -> None:
        self._meta_dirty = False
        self._meta_due = perf_counter() + _META_EVERY_S
        try:
            record = self._meta()
        except Exception as exc:  # metadata is nice to have; a surprise in it must not cost the steps
            self.shipper.warn_once("meta", f"clusterdx hooks: run metadata unavailable: {exc!r}")
            return
        same = self._last_meta is not None and {**self._last_meta, "ts": 0} == {**record, "ts": 0}
        if not same or time.time() - self._last_meta["ts"] >= _META_EVERY_S:  # type: ignore[index]
            self._last_meta = record
            self.shipper.put("runs", record)

    def _meta(self) -> dict[str, Any]:
        ident, parts = self._ident, self._meta_parts
        record: dict[str, Any] = {"run": self.run, "rank": ident.rank, "world_size": ident.world_size,
                                  "ts": time.time(), "host": self.host, **self._static}
        if ident.local_rank is not None:
            record["local_rank"] = ident.local_rank
        for key in ("gpu_index", "gpu_uuid", "gpu_name", "dataloader", "dtype", "last_checkpoint_step",
                    "last_checkpoint_ts"):
            if parts.get(key) is not None:
                record[key] = parts[key]
        record["parallel"] = _parallel(parts["parallel"], ident.world_size)
        if parts["layout"]:
            record["layout"] = dict(parts["layout"])
        if self._params is not None:
            record["params"] = self._params
        flops = self._flops_per_token or (6.0 * self._params if self._params else None)
        if flops is not None:
            record["flops_per_token"] = float(flops)
        peak = meta.peak_flops(parts.get("gpu_name"), parts.get("dtype"))
        if peak is not None:
            record["peak_flops"] = peak
        return record


_monitors: list[Monitor] = []


def _watch_for_crash(mon: Monitor) -> None:
    """Chains ``sys.excepthook`` once per process: an uncaught exception is reported by every Monitor before the
    interpreter runs its exit handlers (which ship it)."""
    _monitors.append(mon)
    if len(_monitors) > 1:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        for m in _monitors:
            with contextlib.suppress(Exception):  # reporting a crash must never mask it
                m._crash(exc)
        previous(kind, exc, tb)

    sys.excepthook = hook


def _parallel(given: dict[str, int], world_size: int) -> dict[str, int]:
    sizes = {k: max(1, int(v)) for k, v in given.items()}
    if "dp" not in sizes:
        model_parallel = 1
        for key in ("tp", "pp", "cp", "ep"):
            model_parallel *= sizes.get(key, 1)
        sizes["dp"] = max(1, world_size // model_parallel)
    return sizes


def batch_size(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor (a tensor, a sequence or a mapping)."""
    for _ in range(3):
        if hasattr(batch, "shape"):
            return int(batch.shape[0]) if len(batch.shape) else None
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, list | tuple):
            batch = batch[0] if batch else None
        else:
            return None
    return None


def _cuda_device(choice: Any) -> Any:
    """The CUDA device to time on, or None for host timing. Never initialises CUDA itself."""
    torch = sys.modules.get("torch")
    if torch is None or (choice is not None and str(choice).startswith("cpu")):
        return None
    if choice is not None and str(choice).startswith("cuda"):
        return torch.device(choice)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _host_scalar(value: Any, deferred: bool) -> Any:
    value = value.detach()
    if deferred and value.is_cuda:
        return value.to("cpu", non_blocking=True)  # read after the step's events are done: no synchronize
    return value.item() if value.numel() == 1 else None


class _MemoryProbe:
    def __init__(self, torch: Any, device: Any, total: int) -> None:
        self._cuda, self._device, self._total = torch.cuda, device, total
        self._due = 0.0
        self._last: tuple[int, int, int] = (0, 0, total)

    def __call__(self) -> tuple[int, int, int]:
        now = perf_counter()
        if now >= self._due:
            self._due = now + _MEM_EVERY_S
            cuda, device = self._cuda, self._device
            self._last = (cuda.memory_allocated(device), cuda.memory_reserved(device), self._total)
        return self._last


class _TimedLoader:
    """The wrapped iterable. ``len()`` passes through so progress bars keep working."""

    def __init__(self, source: Iterable[Any], timer: StepTimer) -> None:
        self._source, self._timer = source, timer

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        it, timer, clock = iter(self._source), self._timer, perf_counter
        while True:
            start = timer.fetching_since = clock()
            try:
                batch = next(it)
            except StopIteration:
                timer.fetching_since = None
                return
            end = clock()
            timer.fetching_since = None
            timer.add_fetch(start, end)
            yield batch


class _StepContext:
    __slots__ = ("args", "mon")

    def __init__(self, mon: Monitor) -> None:
        self.mon = mon
        self.args: tuple[int | None, int | None, int | None] = (None, None, None)

    def __enter__(self) -> _StepContext:
        self.mon.begin_step(*self.args)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.mon.end_step()
        else:
            self.mon.timer.abort()


class _Phase:
    __slots__ = ("name", "start", "timer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name, self.start = timer, name, None

    def __enter__(self) -> _Phase:
        self.start = self.timer.phase_begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.phase_end(self.name, self.start)


class _Comm:
    __slots__ = ("timer", "token")

    def __init__(self, timer: StepTimer) -> None:
        self.timer, self.token = timer, None

    def __enter__(self) -> _Comm:
        self.token = self.timer.comm_begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.comm_end(self.token)  # type: ignore[arg-type]
