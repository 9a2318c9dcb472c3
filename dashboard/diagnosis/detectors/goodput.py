"""MFU per step and goodput per run, as pure functions (the pass stores them: :mod:`dashboard.diagnosis.efficiency`).

MFU of a step = tokens of every rank x FLOPs per token / (peak FLOPS per GPU x GPUs x the step's time).

Goodput = productive training time / wall time since the run's first step began. The wall time splits into:
- productive: step time of the steps the run keeps, each capped at ``STALL_FACTOR`` x the median step;
- ``stall_s``: the excess of a slow step over that cap, and idle gaps between steps (a hang that recovered, a slow
  evaluation, a data pipeline that paused);
- ``checkpoint_s``: the gap after a step at which a checkpoint was saved;
- ``restart_s``: the gap before the run stepped again at a step it had already done (a restart from a checkpoint);
- ``replayed_s``: the first execution of the steps done again after a restart: they were lost.
Small gaps (under ``GAP_MIN_FRAC`` of a median step: the hooks' own bookkeeping) count as productive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

STALL_FACTOR = 3.0
GAP_MIN_FRAC = 0.5
SAME_EXECUTION_S = 5.0  # a step's rows arriving this long after it was folded are late ranks, not a replay


def mfu(tokens: np.ndarray, step_time_s: np.ndarray, flops_per_token: float | None, peak_flops: float | None,
        gpus: int | None) -> np.ndarray:
    """Per step (NaN where unknown)."""
    with np.errstate(all="ignore"):
        if not flops_per_token or not peak_flops or not gpus:
            return np.full(len(tokens), np.nan)
        return tokens * flops_per_token / (peak_flops * gpus * step_time_s)


@dataclass
class Goodput:
    first_start: float | None = None
    last_end: float | None = None
    last_step: int | None = None
    max_step: int | None = None
    productive_s: float = 0.0
    stall_s: float = 0.0
    checkpoint_s: float = 0.0
    restart_s: float = 0.0
    replayed_s: float = 0.0
    restarts: int = 0
    med_step_s: float | None = None
    done: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (end ts, step time), recent ones

    @property
    def wall_s(self) -> float:
        return 0.0 if self.first_start is None or self.last_end is None else self.last_end - self.first_start

    @property
    def goodput(self) -> float | None:
        return min(1.0, self.productive_s / self.wall_s) if self.wall_s > 0 else None

    def figures(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "done"}
        return {**d, "wall_s": self.wall_s, "goodput": self.goodput}


def fold(g: Goodput, rows: list[tuple[int, float, float]], checkpoint_steps: set[int]) -> list[int]:
    """Fold executed steps (step, end ts, step time), oldest first, into ``g``. ``g.done`` holds the executions a
    replay can refer to (the caller seeds it from storage). Returns the steps folded (late rows of an execution
    already folded are skipped)."""
    folded = []
    for step, end, st in rows:
        prev = g.done.get(step)
        if prev is not None and abs(end - prev[0]) < SAME_EXECUTION_S + STALL_FACTOR * (g.med_step_s or st):
            continue
        start = end - st
        med = g.med_step_s if g.med_step_s is not None else st
        gap = max(0.0, start - g.last_end) if g.last_end is not None else 0.0
        if g.first_start is None:
            g.first_start = start
        if g.max_step is not None and step <= g.max_step:  # a restart: it resumed at a step it had done before
            g.restarts += 1
            g.restart_s += gap
            lost = sum(t for s, (_, t) in g.done.items() if step <= s <= g.max_step)
            g.replayed_s += lost
            g.productive_s -= lost
            for s in [s for s in g.done if s >= step]:
                del g.done[s]
            g.max_step = step - 1  # the run goes on from here
        elif g.last_step is not None and g.last_step in checkpoint_steps:
            g.checkpoint_s += gap
        elif gap > GAP_MIN_FRAC * med:
            g.stall_s += gap
        else:
            g.productive_s += gap
        cap = STALL_FACTOR * med
        g.productive_s += min(st, cap)
        g.stall_s += max(0.0, st - cap)
        g.med_step_s = st if g.med_step_s is None else 0.95 * g.med_step_s + 0.05 * min(st, cap)
        g.last_end = max(end, g.last_end or end)
        g.last_step = step
        g.max_step = step if g.max_step is None else max(g.max_step, step)
        g.done[step] = (end, min(st, cap))  # what a replay of it loses: the productive part (the rest was stall)
        folded.append(step)
    return folded
