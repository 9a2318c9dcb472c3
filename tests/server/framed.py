"""Seeding stored samples in tests: GPU samples, steps and probes given as wire-style dicts (field -> value, ``ts`` in
epoch seconds or as a datetime), stored as frames exactly as the ingest writer frames a post's records
(:func:`dashboard.storage.frames.build`), without a post. One call is one post: its samples are split into frames by
the same boundaries ingest uses.

    framed.gpus(cluster, node, [{"ts": t, "index": 0, "util_gpu_pct": 50.0}, ...])
    framed.steps(cluster, node, run, [{"rank": 0, "step": 7, "ts": t, "step_time_s": 1.0}, ...])
    framed.probes(cluster, node, [{"ts": t, "peer": "node-2", "sent": 5, "lost": 0, "rtt_ms": 0.1}, ...])
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dashboard.storage import frames as fr
from dashboard.telemetry import models as m


def _seconds(v: Any) -> Any:
    return v.timestamp() if isinstance(v, datetime) else v


def add(kind: fr.Kind, cluster: m.Cluster | int, node: m.Node | int | None, samples: list[dict[str, Any]],
        run: m.Run | int | None = None) -> list[Any]:
    """Store ``samples`` of ``kind`` as frames; returns the frame rows created. ``gpu_index`` is taken for
    ``index`` (the rows' old column name), so fixtures written for rows read the same."""
    if not samples:
        return []
    cluster_id = getattr(cluster, "id", cluster)
    node_id = getattr(node, "id", node)
    run_id = getattr(run, "id", run)
    rows = []
    for s in samples:
        s = {("index" if k == "gpu_index" else k): _seconds(v) if k == "ts" else v for k, v in s.items()}
        unknown = s.keys() - set(kind.numbers) - set(kind.objects) - {"run", "run_id", "uuid", "name", "pci_bus_id"}
        assert not unknown, f"not a field of a framed {kind.name} sample: {sorted(unknown)}"
        rows.append(s)
    mat = fr.matrix(kind, [tuple(r.get(c) for c in kind.numbers) for r in rows])
    objs = fr.objects(kind, {f: [r.get(f) for r in rows] for f in kind.objects})
    run_ids = None
    if kind is fr.STEPS:
        run_ids = [r.get("run_id", run_id) for r in rows]
        assert all(r is not None for r in run_ids), "a step needs its run (run= or run_id in the sample)"
    out = []
    for b in fr.build(kind, mat, objs, run_ids):
        when = datetime.fromtimestamp(b.ts, UTC)
        common = {"cluster_id": cluster_id, "ts": when, "n": b.n, "layout": kind.layout, "data": b.data}
        if kind is fr.STEPS:
            out.append(m.StepFrame(**common, node_id=node_id, run_id=b.run_id, rank_group=b.rank_group,
                                   step_lo=b.step_lo, step_hi=b.step_hi))
        elif kind is fr.PROBES:
            out.append(m.ProbeFrame(**common, node_id=node_id, peers=b.peers))
        else:
            out.append(m.GpuFrame(**common, node_id=node_id))
    return kind.model._default_manager.bulk_create(out)


def gpus(cluster: m.Cluster | int, node: m.Node | int, samples: list[dict[str, Any]]) -> list[Any]:
    return add(fr.GPUS, cluster, node, samples)


def steps(cluster: m.Cluster | int, node: m.Node | int | None, run: m.Run | int | None,
          samples: list[dict[str, Any]]) -> list[Any]:
    return add(fr.STEPS, cluster, node, samples, run)


def probes(cluster: m.Cluster | int, node: m.Node | int, samples: list[dict[str, Any]]) -> list[Any]:
    return add(fr.PROBES, cluster, node, samples)


def stored(kind: fr.Kind, **filters: Any) -> fr.Rows:
    """The samples of ``kind`` stored in the frames matching ``filters`` (the frame table's columns)."""
    return fr.read(kind, cols=("node_id",), objects=kind.objects, **filters)


def count(kind: fr.Kind, **filters: Any) -> int:
    """How many samples of ``kind`` the frames matching ``filters`` hold."""
    from django.db.models import Sum

    return int(kind.model._default_manager.filter(**filters).aggregate(n=Sum("n"))["n"] or 0)
