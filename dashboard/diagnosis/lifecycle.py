"""Findings lifecycle: detections of one pass become open / updated / resolved rows.

One open row per (cluster, kind, subject). A detection opens a row or refreshes the open one (numbers, severity,
action); a row whose condition is gone is resolved only after it stayed gone for ``CLEAR_AFTER_S`` and at least
``CLEAR_PASSES`` passes (hysteresis: a condition that flickers keeps one row instead of a stream of open/resolve).
Detectors have their own persistence before they speak at all. Browsers hear about every change through the live
``findings`` event after the commit; the alerts app through ``finding_recorded`` inside the transaction (its outbox,
which survives a crash before the hooks run) and ``finding_changed`` after the commit (planning at once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction

from dashboard.diagnosis.detectors.base import SEVERITY_RANK, Detection
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding
from dashboard.diagnosis.signals import finding_changed, finding_recorded
from dashboard.live.broadcast import broadcast, cluster_group
from dashboard.telemetry.models import Cluster, Node, Run

CLEAR_PASSES = 2
CLEAR_AFTER_S = {"failing_gpu": 600.0, "nccl_config": 60.0, "checkpoint_overdue": 60.0}
DEFAULT_CLEAR_AFTER_S = 30.0


@dataclass
class Changes:
    opened: list[Finding] = field(default_factory=list)
    escalated: list[Finding] = field(default_factory=list)
    resolved: list[Finding] = field(default_factory=list)
    updated: list[Finding] = field(default_factory=list)

    @property
    def visible(self) -> list[Finding]:
        return self.opened + self.escalated + self.resolved + self.updated


def _plain(value: Any) -> Any:
    """numpy scalars and other strays into plain JSON values."""
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def reconcile(cluster: Cluster, detections: list[Detection], now: datetime) -> Changes:
    """The transaction holds the database's write lock (on the embedded default, the one lock the ingest writer needs
    too), so whatever need not be in it is done before (each detection's evidence as plain JSON, the node and run ids)
    or after it (the browsers' rows): at 2,048 nodes with every node named it held the lock 2 s a pass, the writer
    waiting behind it."""
    changes = Changes()
    evidence = [_plain(d.evidence) for d in detections]
    refs = _refs(cluster, detections)
    with transaction.atomic():
        open_rows = {(f.kind, f.subject): f for f in
                     Finding.objects.select_for_update().filter(cluster=cluster, state=Finding.State.OPEN)}
        for d, plain in zip(detections, evidence, strict=True):
            f = open_rows.pop(d.key, None)
            if f is None:
                changes.opened.append(_open(cluster, d, now, refs, plain))
            else:
                _refresh(f, d, now, changes, plain)
        for f in open_rows.values():
            _clear(f, now, changes)
        _notify(cluster.id, changes)
    return changes


def _refs(cluster: Cluster, detections: list[Detection]) -> dict[str, dict[str, int]]:
    hosts = {h for d in detections for h in (d.node, d.peer_node) if h}
    runs = {d.run for d in detections if d.run}
    return {"node": dict(Node.objects.filter(cluster=cluster, hostname__in=hosts).values_list("hostname", "id")),
            "run": dict(Run.objects.filter(cluster=cluster, name__in=runs).values_list("name", "id"))}


def _open(cluster: Cluster, d: Detection, now: datetime, refs: dict[str, dict[str, int]], evidence: Any) -> Finding:
    return Finding.objects.create(
        cluster=cluster, run_id=refs["run"].get(d.run or ""), kind=d.kind, subject_type=d.subject_type,
        subject=d.subject[:300], node_id=refs["node"].get(d.node or ""), peer_node_id=refs["node"].get(d.peer_node or ""),
        gpu_index=d.gpu_index, rank=d.rank, severity=d.severity, title=d.title[:300], action=d.action,
        confidence=d.confidence, evidence=evidence, opened_at=now, updated_at=now, last_seen_at=now)


def _refresh(f: Finding, d: Detection, now: datetime, changes: Changes, evidence: Any) -> None:
    escalated = SEVERITY_RANK[d.severity] > SEVERITY_RANK.get(f.severity, 0)
    visible = escalated or d.severity != f.severity or d.title[:300] != f.title
    f.severity, f.title, f.action, f.confidence = d.severity, d.title[:300], d.action, d.confidence
    f.evidence, f.last_seen_at, f.clear_passes = evidence, now, 0
    if visible:
        f.updated_at = now
        (changes.escalated if escalated else changes.updated).append(f)
    f.save(update_fields=["severity", "title", "action", "confidence", "evidence", "last_seen_at", "clear_passes",
                          "updated_at"])


def _clear(f: Finding, now: datetime, changes: Changes) -> None:
    f.clear_passes += 1
    gone_for = (now - f.last_seen_at).total_seconds()
    if f.clear_passes >= CLEAR_PASSES and gone_for >= CLEAR_AFTER_S.get(f.kind, DEFAULT_CLEAR_AFTER_S):
        f.state, f.resolved_at, f.updated_at = Finding.State.RESOLVED, now, now
        changes.resolved.append(f)
    f.save(update_fields=["clear_passes", "state", "resolved_at", "updated_at"])


def _notify(cluster_id: int, changes: Changes) -> None:
    from dashboard.diagnosis.silences import mark

    visible = changes.visible
    if visible:
        def send() -> None:  # after the commit, out of the write lock: the rows and their silences (one query)
            rows = mark([finding_row(f) for f in visible])
            broadcast(cluster_group(cluster_id), {"type": "findings", "cluster": cluster_id, "findings": rows})

        transaction.on_commit(send)
    for event, found in (("opened", changes.opened), ("escalated", changes.escalated),
                         ("resolved", changes.resolved)):
        for f in found:
            finding_recorded.send(sender=Finding, finding=f, event=event)  # commits with the change, or not at all
            transaction.on_commit(lambda f=f, event=event: finding_changed.send(sender=Finding, finding=f,
                                                                               event=event))
