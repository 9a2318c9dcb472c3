"""Findings as the browser sees them (snapshot and live event rows)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q

from dashboard.diagnosis.models import Finding


def finding_row(f: Finding) -> dict[str, Any]:
    """A finding as every page lists it, with the links to its own page and to its subject's."""
    from dashboard.web.evidence_headline import headline
    from dashboard.web.links import finding_url, subject_url

    return {"id": f.id, "kind": f.kind, "state": f.state, "severity": f.severity, "subject": f.subject,
            "subject_type": f.subject_type, "title": f.title, "action": f.action, "confidence": f.confidence,
            "run": f.run_id, "node": f.node.hostname if f.node_id else None, "gpu_index": f.gpu_index,
            # a link's far end: the overview marks both ends on its health map as findings come and go
            "peer_node": f.peer_node.hostname if f.peer_node_id else None,
            "rank": f.rank, "opened_at": f.opened_at.timestamp(), "updated_at": f.updated_at.timestamp(),
            "headline": headline(f), "url": finding_url(f.id), "subject_url": subject_url(f),
            # Who is on it (dashboard.diagnosis.silences); ``silenced`` is added by silences.mark, one query a list.
            "cluster_id": f.cluster_id, "acked_by": f.acked_by_name or None,
            "acked_at": f.acked_at.timestamp() if f.acked_at else None}


def findings_for(cluster_id: int, run_id: int | None) -> list[dict[str, Any]]:
    """Open findings of a cluster or, for a run page, of that run: its own and those of the nodes its ranks run on
    (a dead node, a failing GPU) — the same rule as ``/api/v1/findings?run=``."""
    qs = Finding.objects.filter(cluster_id=cluster_id, state=Finding.State.OPEN)
    if run_id is not None:
        qs = qs.filter(Q(run_id=run_id) | Q(node__ranks__run_id=run_id)).distinct()
    qs = qs.select_related("cluster", "node", "peer_node")
    from dashboard.diagnosis.silences import mark

    return mark([finding_row(f) for f in qs.order_by("-updated_at")[:100]])
