"""The arithmetic of a training step, with no framework import: data wait, compute, communication, phases.

A step's window starts when the loop asks for its batch and ends when the step body ends::

    |-- data wait --|.....|------------------- body ------------------------|
    fetch begin   fetch end  begin     [comm]  [comm]          [comm]        end
                                        ^ first collective: comm_arrive_s

* ``step_time_s``  window length (host clock);
* ``data_wait_s``  the fetch (host clock);
* ``comm_s``       time during which at least one collective of the step was in flight (union of intervals;
  DDP's bucket all-reduces overlap each other and the backward pass, so a plain sum would count twice); with the
  process-group tracer (:mod:`trainer_hooks.collectives`), only the part the step was held by it: the union of the
  waits it saw, plus the time in flight of collectives waited for out of its sight (DDP's reducer);
* ``compute_s``    body minus ``comm_s``: a rank that waits for its peers shows comm, the late one shows compute;
* ``groups``       the same per process group (:func:`trainer_hooks.collectives.summarize`);
* ``comm_arrive_s`` when this rank launched its first collective, from the window start: the last to arrive is
  the rank the others waited for, whether its batch or its compute was slow.

Body, phases and collectives are measured with a *clock*: on the CPU ``perf_counter``; on CUDA, events recorded
on the current stream and read only once :meth:`CudaClock.ready` says the GPU got there — a step or two later,
so the hook never synchronizes. Steps whose events are not done after ``max_pending`` steps are shipped without
GPU timings instead of waiting. Every finished step is held until the next one begins, so metrics logged after
the step body (a loss read after the ``with`` block, HF's ``on_log``) still join their step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

perf_counter = time.perf_counter
Memory = tuple[int, int, int]  # allocated, reserved, total bytes of the step's device
_NO_MEMORY: Memory = (0, 0, 0)  # identity-compared: off CUDA the fields are left out, not reported as 0


class Clock(Protocol):
    deferred: bool  # True when marks are read later (CUDA events), False when they are times already

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def release(self, mark: Any) -> None: ...


class CpuClock:
    deferred = False

    mark = staticmethod(perf_counter)

    @staticmethod
    def ready(mark: Any) -> bool:
        return True

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        return end - start

    @staticmethod
    def release(mark: Any) -> None:
        return None


class CudaClock:
    """CUDA events from a recycled pool (creating an event per mark would cost more than recording it)."""

    deferred = True

    def __init__(self, event_factory: Callable[[], Any]) -> None:
        self._new = event_factory
        self._pool: list[Any] = []

    def mark(self) -> Any:
        event = self._pool.pop() if self._pool else self._new()
        event.record()  # on the current stream: the GPU reaches it after the work queued so far
        return event

    @staticmethod
    def ready(mark: Any) -> bool:
        return bool(mark.query())  # cudaEventQuery: never blocks

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def release(self, mark: Any) -> None:
        if len(self._pool) < 256:
            self._pool.append(mark)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class FinishedStep:
    """A step whose host times are known and whose clock marks may still be in flight on the GPU.

    The timer hands these to ``emit`` once they can be read; :meth:`as_record` turns one into a wire ``Step``
    dict. That work (float formatting, interval union, event reads) is left to whoever ships the step — the
    Monitor's background thread — so the training thread pays only for the clock reads."""

    __slots__ = ("begin", "calls", "comms", "data_wait", "end", "lead", "mem", "metrics", "phases", "rank",
                 "ready_mark", "samples", "step", "step_time", "timed", "timer", "tokens", "ts")

    def __init__(self, timer: StepTimer, step: int, ts: float, step_time: float, data_wait: float | None,
                 lead: float, begin: Any, end: Any, phases: list[Any], comms: list[Any], tokens: int | None,
                 samples: int | None, metrics: dict[str, Any], mem: Memory, calls: list[Any] | None = None) -> None:
        self.timer, self.rank, self.timed = timer, timer.rank, True
        self.step, self.ts, self.step_time, self.data_wait, self.lead = step, ts, step_time, data_wait, lead
        self.begin, self.end, self.phases, self.comms = begin, end, phases, comms
        self.calls = calls or []  # trainer_hooks.collectives.Call: the step's collectives, by process group
        self.ready_mark = end  # the last mark to wait for: later when a tensor is logged after the step
        self.tokens, self.samples, self.metrics, self.mem = tokens, samples, metrics, mem

    def as_record(self) -> dict[str, Any]:
        return self.timer._record(self)


class StepTimer:
    """Measures steps and hands each :class:`FinishedStep` to ``emit`` once its marks are readable (at the next
    ``begin``, or ``poll``); the step's ``as_record()`` is its wire ``Step`` dict.

    Call order per step: ``fetch_begin``/``fetch_end`` (optional), ``begin``, any number of ``phase_*`` and
    ``comm_*``, ``end``. ``comm_begin``/``comm_end`` may be called from another thread (gloo completes
    collectives on its own threads). Nothing here raises into the training loop for bad timing data.
    """

    def __init__(self, run: str, rank: int, emit: Callable[[FinishedStep], None], clock: Clock | None = None,
                 max_pending: int = 8) -> None:
        self.run, self.rank, self._emit = run, rank, emit
        self.clock: Clock = clock or CpuClock()
        self.max_pending = max_pending
        # Told (step, metric name) when a logged value is NaN or infinite: the wire cannot carry it, the run must know.
        self.on_nonfinite: Callable[[int, str], None] | None = None
        self.late = 0  # steps shipped without GPU timings because their events were not done in time
        self.step = 0  # the number the next step gets
        self._pending: deque[FinishedStep] = deque()
        self._fetch: tuple[float, float] | None = None
        self._fetch_t0 = 0.0
        self._open = False
        self._begin_host = 0.0
        self._begin_mark: Any = None
        self._phases: list[tuple[str, Any, Any]] = []
        self._comms: list[tuple[Any, Any]] = []
        self._calls: list[Any] = []  # filled by trainer_hooks.collectives while a step is open
        self._metrics: dict[str, Any] = {}
        self._mem: Callable[[], Memory] | None = None
        self._step_args: tuple[int | None, int | None, int | None] = (None, None, None)
        # Where the training thread is, for the beats the shipping thread sends (plain attribute writes only):
        self.fetching_since: float | None = None  # host time a batch fetch began, while it is in progress
        self.last_step: int | None = None  # the last step that ended
        self._end_host = perf_counter()  # when it ended (or the timer was made)

    def where(self) -> tuple[str, float]:
        """(``idle`` | ``data`` | ``step``, seconds in that state). Read from another thread: a torn read costs one
        beat's accuracy, never a crash."""
        now = perf_counter()
        fetching = self.fetching_since
        if fetching is not None:
            return "data", max(0.0, now - fetching)
        if self._open:
            return "step", max(0.0, now - self._begin_host)
        return "idle", max(0.0, now - self._end_host)

    # -- the data wait ------------------------------------------------------------------------------------------
    def fetch_begin(self) -> None:
        self._fetch_t0 = perf_counter()

    def fetch_end(self) -> None:
        self._fetch = (self._fetch_t0, perf_counter())

    def add_fetch(self, start: float, end: float) -> None:
        """A fetch measured by the caller (the loader wrapper inlines its clock reads)."""
        self._fetch = (start, end)

    # -- the step ------------------------------------------------------------------------------------------------
    def begin(self, step: int | None = None, tokens: int | None = None, samples: int | None = None) -> None:
        if self._open:  # a step that never ended (an exception between begin and end): forget it
            self._reset()
        if self._pending:
            self.poll()
        self._open = True
        self._step_args = (step, tokens, samples)
        self._begin_host = now = perf_counter()
        self._begin_mark = now if not self.clock.deferred else self.clock.mark()

    def count(self, tokens: int | None = None, samples: int | None = None) -> None:
        """Tokens or samples known only once the step ran (variable-length batches, framework counters)."""
        step, old_tokens, old_samples = self._step_args
        self._step_args = (step, old_tokens if tokens is None else tokens, old_samples if samples is None else samples)

    def end(self) -> None:
        if not self._open:
            return
        clock = self.clock
        end_mark = clock.mark()
        end_host = end_mark if not clock.deferred else perf_counter()
        step, tokens, samples = self._step_args
        if step is None:
            step = self.step
        self.step = step + 1
        self.last_step, self._end_host = step, end_host
        fetch, self._fetch = self._fetch, None
        start = fetch[0] if fetch is not None else self._begin_host
        mem = self._mem() if self._mem is not None else _NO_MEMORY
        done = FinishedStep(
            self, step, time.time(), end_host - start, (fetch[1] - fetch[0]) if fetch is not None else None,
            self._begin_host - start, self._begin_mark, end_mark, self._phases, self._comms, tokens, samples,
            self._metrics, mem, self._calls,
        )
        self._open = False
        self._phases, self._comms, self._metrics, self._calls = [], [], {}, []
        # Held until the next begin(): what is logged after the step (loss.item(), HF's on_log) still joins it.
        self._pending.append(done)

    def abort(self) -> None:
        """The step raised: it is not a step the server should average over."""
        self._reset()

    def _reset(self) -> None:
        self._open = False
        self._fetch = None
        for mark in (self._begin_mark, *(m for _, a, b in self._phases for m in (a, b))):
            self.clock.release(mark)
        self._phases, self._comms, self._calls = [], [], []

    def poll(self, force: bool = False) -> None:
        """Ship finished steps whose GPU marks are done; the oldest go without GPU timings past ``max_pending``.

        ``force`` (at close only) waits for the marks: training is over, a synchronize costs nothing then."""
        pending, clock = self._pending, self.clock
        while pending:
            oldest = pending[0]
            if force and hasattr(oldest.ready_mark, "synchronize"):
                oldest.ready_mark.synchronize()
            if clock.ready(oldest.ready_mark):
                self._emit(pending.popleft())
            elif len(pending) > self.max_pending:
                self.late += 1
                oldest.timed = False
                self._emit(pending.popleft())
            else:
                return

    # -- phases, collectives, metrics ------------------------------------------------------------------------------
    def phase_begin(self) -> Any:
        return self.clock.mark()

    def phase_end(self, name: str, start: Any) -> None:
        self._phases.append((name, start, self.clock.mark()))

    def comm_begin(self) -> tuple[list[tuple[Any, Any]], Any]:
        """Returns a token for :meth:`comm_end`; it pins the step's list so a late completion cannot leak into the
        next step."""
        return self._comms, self.clock.mark()

    def comm_end(self, token: tuple[list[tuple[Any, Any]], Any]) -> None:
        comms, start = token
        comms.append((start, self.clock.mark()))

    @property
    def in_step(self) -> bool:
        return self._open

    def log(self, values: dict[str, Any], device_copies: bool = False) -> None:
        """Metrics for the open step; between steps, for the step that just ended (the next one before any).

        ``device_copies``: some values are host copies still in flight from the GPU. Logged after the step's end
        mark, they get a mark of their own, so the step is read only once the copies landed too."""
        if not self._open and self._pending:
            done = self._pending[-1]
            done.metrics.update(values)
            if device_copies and self.clock.deferred:
                if done.ready_mark is not done.end:
                    self.clock.release(done.ready_mark)
                done.ready_mark = self.clock.mark()
        else:
            self._metrics.update(values)

    def set_memory_probe(self, probe: Callable[[], Memory] | None) -> None:
        self._mem = probe

    # -- turning marks into a wire record --------------------------------------------------------------------------
    def _record(self, done: FinishedStep) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "run": self.run, "rank": done.rank, "step": done.step, "ts": done.ts,
            "step_time_s": max(0.0, done.step_time),
        }
        if done.data_wait is not None:
            rec["data_wait_s"] = max(0.0, done.data_wait)
        if done.timed:
            try:
                self._timings(done, rec)
            except RuntimeError:  # a mark recorded on another stream was not done yet: ship without GPU times
                self.late += 1
                for key in ("comm_s", "comm_arrive_s", "compute_s", "phases", "groups"):
                    rec.pop(key, None)
        self._release(done)
        for key, value in (("tokens", done.tokens), ("samples", done.samples)):
            if value is not None:
                rec[key] = int(value)
        if done.metrics and not done.timed:  # host copies from the GPU may not have landed: never read them
            done.metrics = {k: v for k, v in done.metrics.items() if not hasattr(v, "detach")}
        if done.metrics:
            metrics = _finite(done.metrics)
            if metrics:
                rec["metrics"] = metrics
            if len(metrics) < len(done.metrics) and self.on_nonfinite is not None:
                for key in done.metrics.keys() - metrics.keys():
                    self.on_nonfinite(done.step, key)
        if done.mem is not _NO_MEMORY:
            rec["mem_allocated_bytes"], rec["mem_reserved_bytes"], rec["mem_total_bytes"] = done.mem
        return rec

    def _timings(self, done: FinishedStep, rec: dict[str, Any]) -> None:
        seconds, begin = self.clock.seconds, done.begin
        body = seconds(begin, done.end)
        comm = 0.0
        if done.calls:
            from trainer_hooks.collectives import summarize

            extra = [(seconds(begin, a), seconds(begin, b)) for a, b in done.comms]
            rec["groups"], comm, rec["comm_arrive_s"] = summarize(done.calls, seconds, begin, body, done.lead, extra)
            rec["comm_s"] = comm
        elif done.comms:
            spans = [(seconds(begin, a), seconds(begin, b)) for a, b in done.comms]
            comm = union_length(spans)
            rec["comm_s"] = comm
            rec["comm_arrive_s"] = max(0.0, done.lead + min(s for s, _ in spans))
        rec["compute_s"] = max(0.0, body - comm)
        if done.phases:
            phases: dict[str, float] = {}
            for name, a, b in done.phases:
                phases[name] = phases.get(name, 0.0) + max(0.0, seconds(a, b))
            rec["phases"] = phases

    def _release(self, done: FinishedStep) -> None:
        release = self.clock.release
        if not self.clock.deferred:
            return
        release(done.begin)
        release(done.end)
        if done.ready_mark is not done.end:
            release(done.ready_mark)
        for _, a, b in done.phases:
            release(a)
            release(b)
        for a, b in done.comms:
            release(a)
            release(b)
        for call in done.calls:
            for mark in (call.start, call.end, *(m for w in call.waits for m in w)):
                if mark is not None:
                    release(mark)


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """Numbers only, finite only: the wire refuses NaN, and the caller reports a non-finite loss separately."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[key[:128]] = number
    return out
