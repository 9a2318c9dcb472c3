"""Detectors over the process-group timings (``Step.groups``): the late rank named *within its group*, and exposed
communication.

Under tensor, pipeline or sharded data parallelism a slow rank makes only its group's peers wait, and they wait in
that group's collectives: the rank is late at the group's first collective (``arrive_s``) and blocked the least
(``exposed_s``), while its peers are blocked for it. Each group instance (role, index) is judged on its own
members, at every step; a rank must be its group's laggard in >= ``persist_steps`` of its last ``recent_steps``
steps. Roles are judged from the innermost out (tp, cp, ep, pp, then dp): the slow TP rank also makes its whole DP
replica late at the data-parallel all-reduce, which is its consequence, not a second culprit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.base import Detection, Thresholds, nanmedian, rnd
from dashboard.diagnosis.detectors.gpu import gpu_state
from dashboard.diagnosis.detectors.steps import RunSteps, _persistent, _starvation_action, _straggler_action, _window, run_steps
from dashboard.diagnosis.detectors.window import RankInfo, Window

ROLE_ORDER = ("tp", "cp", "ep", "pp", "dp", "world", "other")
INNER = ("tp", "cp", "ep", "pp")
ROLE_NAME = {"tp": "tensor-parallel", "cp": "context-parallel", "ep": "expert-parallel", "pp": "pipeline",
             "dp": "data-parallel", "world": "world", "other": "process"}
# A lag under 10 ms is jitter whatever the step time: a loaded host's scheduler moves ranks by 3 ms, and on the
# testbed (4 ranks sharing 2 cores) a rank computing 10 % slower for a few steps arrived 6 ms late at 3 of 5 steps of
# its 80 ms step. The same floor as data_min_s; a real straggler is a share of a step of hundreds of ms.
MIN_LAG_S = 0.01
WORST_SHARE = 0.1  # a member is late only if at least this share as late as the group's latest at that step
EXPOSED_WARN = 0.30  # exposed (not overlapped) communication share of the step
EXPOSED_ERROR = 0.50
_NO_RANK = RankInfo(None, None, {})


@dataclass
class Group:
    """One group instance over the recent steps: member ranks and [member x step] matrices."""

    role: str
    index: int
    ranks: list[int]
    arrive: np.ndarray
    exposed: np.ndarray
    group_rank: dict[int, int] = field(default_factory=dict)


def _groups(rs: RunSteps, cells: np.ndarray) -> list[Group]:
    """``cells``: [rank x step] of GroupTiming lists (None where absent)."""
    found: dict[tuple[str, int], dict[int, dict[int, dict[str, Any]]]] = {}  # (role, index) -> rank -> step -> g
    for i in range(cells.shape[0]):
        for j in range(cells.shape[1]):
            for g in cells[i, j] or ():
                key = (g.get("role") or "other", int(g.get("index") or 0))
                found.setdefault(key, {}).setdefault(i, {})[j] = g
    out = []
    n_steps = cells.shape[1]
    for (role, index), members in found.items():
        rows = sorted(members)
        arrive, exposed = np.full((len(rows), n_steps), np.nan), np.full((len(rows), n_steps), np.nan)
        grank = {}
        for k, i in enumerate(rows):
            for j, g in members[i].items():
                arrive[k, j] = np.nan if g.get("arrive_s") is None else g["arrive_s"]
                exposed[k, j] = np.nan if g.get("exposed_s") is None else g["exposed_s"]
                grank[int(rs.ranks[i])] = int(g.get("group_rank") or 0)
        if len(rows) >= 2:
            out.append(Group(role, index, [int(rs.ranks[i]) for i in rows], arrive, exposed, grank))
    out.sort(key=lambda g: (ROLE_ORDER.index(g.role) if g.role in ROLE_ORDER else 99, g.index))
    return out


def _half_median(x: np.ndarray, upper: bool) -> float:
    """The median of the lower (or upper) half of the values: the healthy members' picture even when up to half
    of the group is late together."""
    v = np.sort(x[~np.isnan(x)])
    if len(v) == 0:
        return float("nan")
    k = (len(v) + 1) // 2
    return float(np.median(v[-k:] if upper else v[:k]))


def _lag(g: Group) -> np.ndarray:
    """[member x step]: how long the other members waited for this one: how much later than the early half it
    arrived, or how much less it was blocked than the most-blocked half (they were blocked waiting for it). At a
    step where more than half the group would lag, nobody lags (one fast member is not everyone else's fault)."""
    lag = np.zeros_like(g.arrive)
    for j in range(g.arrive.shape[1]):
        a, e = g.arrive[:, j], g.exposed[:, j]
        with np.errstate(all="ignore"):
            lag[:, j] = np.fmax(a - _half_median(a, upper=False), _half_median(e, upper=True) - e)
    return np.nan_to_num(lag, nan=0.0)


def _has_groups(w: Window, ri: int) -> bool:
    """Whether any of the run's rows carries group timings (hooks older than them send none: skip the run cheaply)."""
    t = w.steps
    return "groups" in t.obj and len(t) > 0 and any(t["groups"][t["run"] == ri])  # any(): no frame per row


def _cells(w: Window, rs: RunSteps, ri: int) -> np.ndarray | None:
    t = w.steps
    if "groups" not in t.obj or not len(t):
        return None
    rows = np.nonzero(t["run"] == ri)[0]
    cells = np.empty((len(rs.ranks), len(rs.steps)), dtype=object)
    r_of = {float(r): i for i, r in enumerate(rs.ranks)}
    s_of = {float(s): j for j, s in enumerate(rs.steps)}
    any_group = False
    for k in rows:
        i, j = r_of.get(float(t["rank"][k])), s_of.get(float(t["step"][k]))
        if i is not None and j is not None and t["groups"][k]:
            cells[i, j] = t["groups"][k]
            any_group = True
    return cells if any_group else None


# -- late rank within its group -------------------------------------------------------------------------------------

def late_in_groups(w: Window, t: Thresholds) -> list[Detection]:
    out: list[Detection] = []
    for ri in range(len(w.runs)):
        if not _has_groups(w, ri):
            continue
        rs = run_steps(w, ri, ("data_wait_s", "compute_s"), t.recent_steps + 3)
        cells = _cells(w, rs, ri) if rs is not None else None
        if rs is None or cells is None:
            continue
        out += _late_run(w, rs, _groups(rs, cells), t)
    return out


def _late_run(w: Window, rs: RunSteps, groups: list[Group], t: Thresholds) -> list[Detection]:
    present = ~np.isnan(rs.m["step_time_s"])
    row = {int(r): i for i, r in enumerate(rs.ranks)}
    inner_of: dict[int, set[tuple[str, int]]] = {}
    for g in groups:
        if g.role in INNER:
            for r in g.ranks:
                inner_of.setdefault(r, set()).add((g.role, g.index))
    named: dict[int, Detection] = {}
    blamed: set[tuple[str, int]] = set()  # inner groups that hold a named culprit
    late_by_role: dict[str, set[int]] = {}
    lags = [_lag(g) for g in groups]
    floors = [_min_lag(rs, g, t) for g in groups]
    # The run waits for its latest rank, whichever group it is in: at each step, the largest lag any group has
    # above its floor.
    worst = np.zeros(lags[0].shape[1] if lags else 0)
    for lag, floor in zip(lags, floors, strict=True):
        worst = np.fmax(worst, np.where(lag >= floor, lag, 0.0).max(axis=0))
    for g, lag, min_lag in zip(groups, lags, floors, strict=True):
        # The group waits for its latest member, and the run for its latest rank: one a tenth as late costs nothing
        # while that one is there (a loaded host's 16 ms beside a rank starved for 500 ms was named; in another
        # group, the 20 ms by which a busy rank trails the slow rank's echo through the data-parallel all-reduce),
        # and once it is fixed the next pass names the other if it persists.
        flags = (lag >= min_lag) & (lag >= WORST_SHARE * np.fmax(lag.max(axis=0, keepdims=True), worst))
        flags[:, flags.sum(axis=0) > len(g.ranks) / 2] = False
        mine = present[[row[r] for r in g.ranks]]
        hit = _persistent(flags & mine, mine, t.recent_steps, t.persist_steps)
        for k in np.nonzero(hit)[0]:
            r = g.ranks[k]
            late_by_role.setdefault(g.role, set()).add(r)
            if r in named or (g.role not in INNER and inner_of.get(r, set()) & blamed):
                continue  # its lateness here is its inner group's culprit's doing
            named[r] = _culprit(w, rs, g, k, lag, flags, groups, t)
            if g.role in INNER:
                blamed.add((g.role, g.index))
    for d in named.values():  # a whole DP replica late together: say so on each of its ranks
        rep = _replica(d.rank, groups, late_by_role.get("dp", set()))
        if rep:
            d.evidence["metrics"]["replica"] = rep
    return list(named.values())


def _min_lag(rs: RunSteps, g: Group, t: Thresholds) -> float:
    min_lag = max(t.late_min_frac * rs.step_med, MIN_LAG_S)
    if g.role == "pp":
        # A pipeline's stages wait for one another by design: the first stage is blocked for the last one's
        # backward, the last one for the first activations. Only a lag beyond the schedule's bubble is a slow stage
        # (2% of the step named the last stage of a healthy real pipeline).
        min_lag = max(min_lag, _bubble(rs, len(g.ranks)) * rs.step_med)
    return min_lag


def _bubble(rs: RunSteps, stages: int) -> float:
    """The share of a step a balanced pipeline idles, (S-1)/(M+S-1) for GPipe and 1F1B; M, the micro-batches, from
    the layout (as many as stages when no rank says)."""
    micro = Counter(int(m) for r in rs.run.ranks.values()
                    if isinstance(m := (r.meta.get("layout") or {}).get("pp_microbatches"), int) and m > 0)
    m = micro.most_common(1)[0][0] if micro else stages
    return (stages - 1) / (m + stages - 1)


def _replica(rank: int | None, groups: list[Group], late_dp: set[int]) -> dict[str, Any] | None:
    for g in groups:
        if g.role in INNER and rank in g.ranks and len(g.ranks) > 1 and set(g.ranks) <= late_dp:
            return {"role": g.role, "index": g.index, "ranks": g.ranks}
    return None


def _culprit(w: Window, rs: RunSteps, g: Group, k: int, lag: np.ndarray, flags: np.ndarray, groups: list[Group],
             t: Thresholds) -> Detection:
    rank = g.ranks[k]
    info = rs.run.ranks.get(rank) or _NO_RANK
    i = int(np.nonzero(rs.ranks == rank)[0][0])
    peers = np.array([int(np.nonzero(rs.ranks == r)[0][0]) for r in g.ranks if r != rank])
    cols = np.nonzero(flags[k])[0]
    recent = np.nonzero(~np.isnan(rs.m["step_time_s"][i]))[0][-t.recent_steps:]
    data, comp = rs.m["data_wait_s"], rs.m["compute_s"]
    with np.errstate(all="ignore"):
        ddata = float(np.nansum(data[i, cols] - nanmedian(data[peers][:, cols], axis=0)))
        dcomp = float(np.nansum(comp[i, cols] - nanmedian(comp[peers][:, cols], axis=0)))
    starved = ddata >= dcomp and ddata > 0
    lag_s = float(np.median(lag[k, cols]))
    where = f" on {info.node}" + (f" GPU {info.gpu}" if info.gpu is not None else "") if info.node else ""
    role = ROLE_NAME.get(g.role, g.role)
    in_group = f"{g.role} rank {g.group_rank.get(rank, '?')} of {g.role} group {g.index}"
    metrics: dict[str, Any] = {
        "role": g.role, "group_index": g.index, "group_rank": g.group_rank.get(rank), "group_ranks": g.ranks[:64],
        "lag_s": rnd(lag_s, 4), "steps_flagged": f"{int(flags[k][recent].sum())}/{len(recent)}",
        "data_wait_s": rnd(np.nanmedian(data[i, cols])), "group_data_wait_s": rnd(np.nanmedian(data[peers][:, cols])),
        "compute_s": rnd(np.nanmedian(comp[i, cols])), "group_compute_s": rnd(np.nanmedian(comp[peers][:, cols]))}
    if g.role == "pp":
        metrics["bubble_by_stage"] = _bubbles(rs, g)
        what = f"Pipeline stage {g.group_rank.get(rank, '?')} (rank {rank}{where}) is the slow stage"
        title = f"{what}: the other stages of pipeline {g.index} wait {lag_s * 1e3:.0f} ms per step for it"
    else:
        title = (f"Rank {rank}{where} ({in_group}) arrives {lag_s * 1e3:.0f} ms late at its {role} collectives"
                 + (": it waits for data" if starved else ""))
    if starved:
        dl = info.meta.get("dataloader") or {}
        action = _starvation_action(rank, float(np.nanmedian(data[i, cols] / rs.m["step_time_s"][i, cols])), dl,
                                    None, (w.hosts.get(info.node) or {}).get("cpu_pct") if info.node else None)
    else:
        gpu = gpu_state(w, info.node, info.gpu) if info.node and info.gpu is not None else None
        metrics["gpu"] = gpu
        action = _straggler_action(rank, gpu)
    action += f" Its {role} group ({len(g.ranks)} ranks: {', '.join(map(str, g.ranks[:16]))}) waits for it."
    series = {"step": rs.steps.astype(int).tolist(),
              "arrive_s": {str(r): [rnd(v, 4) for v in g.arrive[n]] for n, r in enumerate(g.ranks[:16])},
              "exposed_s": {str(r): [rnd(v, 4) for v in g.exposed[n]] for n, r in enumerate(g.ranks[:16])}}
    return Detection(
        "data_starvation" if starved else "straggler", "rank", f"{rs.run.name}/rank{rank}",
        "error" if lag_s >= 0.1 * rs.step_med else "warning", title, action,
        {"metrics": metrics, "window": _window(rs), "series": {"group_arrivals": series}},
        0.9, node=info.node, gpu_index=info.gpu, rank=rank, run=rs.run.name)


def _bubbles(rs: RunSteps, g: Group) -> dict[str, float | None]:
    """Pipeline stage -> the median share of its step it sat blocked in the pipeline's sends/receives."""
    out = {}
    for n, r in enumerate(g.ranks):
        i = int(np.nonzero(rs.ranks == r)[0][0])
        with np.errstate(all="ignore"):
            out[str(g.group_rank.get(r, n))] = rnd(np.nanmedian(g.exposed[n] / rs.m["step_time_s"][i]))
    return dict(sorted(out.items()))


# -- exposed communication ------------------------------------------------------------------------------------------

def exposed_comm(w: Window, t: Thresholds, excused: set[str] | None = None) -> list[Detection]:
    """``excused``: runs with a named late rank (their peers' waiting is that rank's doing, not the layout's)."""
    out = []
    for ri, run in enumerate(w.runs):
        if (excused and run.name in excused) or not _has_groups(w, ri):
            continue
        rs = run_steps(w, ri, (), t.recent_steps + 3)
        cells = _cells(w, rs, ri) if rs is not None else None
        if rs is None or cells is None:
            continue
        by_role: dict[str, np.ndarray] = {}
        for i in range(cells.shape[0]):
            for j in range(cells.shape[1]):
                for g in cells[i, j] or ():
                    m = by_role.setdefault(g.get("role") or "other", np.zeros(cells.shape))
                    m[i, j] += g.get("exposed_s") or 0.0
        with np.errstate(all="ignore"):
            total = sum(by_role.values()) / rs.m["step_time_s"]
            share = nanmedian(total, axis=0, keepdims=True)
        present = ~np.isnan(share)
        if not _persistent(np.nan_to_num(share >= EXPOSED_WARN, nan=0).astype(bool), present, t.recent_steps,
                           t.persist_steps)[0]:
            continue
        s = float(np.nanmedian(share[0, -t.recent_steps:]))
        with np.errstate(all="ignore"):
            roles = {r: rnd(np.nanmedian(nanmedian(m / rs.m["step_time_s"], axis=0)[-t.recent_steps:]))
                     for r, m in by_role.items()}
        out.append(_exposed_detection(w, rs, cells, s, roles))
    return out


def _majority(values: list[Any]) -> Any:
    """The value most ranks reported (dicts compared by their repr)."""
    vals = {repr(v): v for v in values if v}
    if not vals:
        return None
    top = Counter(repr(v) for v in values if v).most_common(1)[0][0]
    return vals[top]


def _exposed_detection(w: Window, rs: RunSteps, cells: np.ndarray, share: float,
                       roles: dict[str, Any]) -> Detection:
    run = rs.run
    layout = _majority([(r.meta.get("layout") or None) for r in run.ranks.values()]) or {}
    env = _majority([(r.meta.get("env") or None) for r in run.ranks.values()]) or {}
    worst = max(roles, key=lambda r: roles[r] or 0)
    todo, facts = [], [f"{ROLE_NAME.get(r, r)} {v:.0%}" for r, v in sorted(roles.items(), key=lambda x: -(x[1] or 0))
                       if v]
    spans = _tp_across_nodes(rs, cells)
    if spans:
        todo.append(f"keep tensor parallelism within a node: tp group {spans['index']} spans "
                    f"{', '.join(spans['hosts'])} (TP traffic needs NVLink; put the tp dimension innermost in the mesh)")
    strategy = (layout.get("strategy") or "").lower()
    if worst == "dp" or (worst == "world" and not spans):
        if "deepspeed" in strategy:
            todo.append("set overlap_comm=true and raise reduce_bucket_size / allgather_bucket_size")
        elif "fsdp" in strategy:
            todo.append("turn on backward_prefetch=BACKWARD_PRE and forward_prefetch (FSDP2: set "
                        "reshard_after_forward=False on the last blocks) so the all-gathers overlap compute")
        else:
            todo.append("raise DDP's bucket_cap_mb (default 25) and set gradient_as_bucket_view=True so the "
                        "all-reduce overlaps the backward pass")
        ga = layout.get("grad_accum")
        todo.append(f"accumulate gradients over more micro-batches (now {ga or 1}) with no_sync() so the "
                    "all-reduce runs once per optimizer step")
    if worst == "pp":
        todo.append(f"more pipeline micro-batches (now {layout.get('pp_microbatches') or '?'}) or an interleaved "
                    f"schedule (now {layout.get('pp_schedule') or '?'}) to shrink the bubble")
    if env.get("NCCL_ALGO"):
        todo.append(f"unset NCCL_ALGO={env['NCCL_ALGO']} (forcing an algorithm overrides NCCL's per-size tuning)")
    sev = "error" if share >= EXPOSED_ERROR else "warning"
    return Detection(
        "exposed_comm", "run", run.name, sev,
        f"{run.name} spends {share:.0%} of each step blocked in communication (mostly {ROLE_NAME.get(worst, worst)})",
        f"Communication not overlapped with compute: {', '.join(facts)} of the step → " + "; ".join(todo) + ".",
        {"metrics": {"exposed_share": rnd(share), "by_role": roles, "layout": layout or None,
                     "nccl_algo": env.get("NCCL_ALGO"), "tp_across_nodes": spans},
         "window": _window(rs)},
        0.85, run=run.name)


def _tp_across_nodes(rs: RunSteps, cells: np.ndarray) -> dict[str, Any] | None:
    members: dict[int, set[int]] = {}
    for i in range(cells.shape[0]):
        for j in range(cells.shape[1]):
            for g in cells[i, j] or ():
                if g.get("role") == "tp":
                    members.setdefault(int(g.get("index") or 0), set()).add(i)
    for index, rows in sorted(members.items()):
        hosts = sorted({(rs.run.ranks.get(int(rs.ranks[i])) or _NO_RANK).node or "?" for i in rows})
        if len(hosts) > 1:
            return {"index": index, "hosts": hosts[:8]}
    return None
