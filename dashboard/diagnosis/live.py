"""Findings as the browser sees them (snapshot and live event rows)."""

from __future__ import annotations

from typing import Any

from dashboard.diagnosis.models import Finding


def finding_row(f: Finding) -> dict[str, Any]:
    return {"id": f.id, "kind": f.kind, "state": f.state, "severity": f.severity, "subject": f.subject,
            "subject_type": f.subject_type, "title": f.title, "action": f.action, "confidence": f.confidence,
            "run": f.run_id, "opened_at": f.opened_at.timestamp(), "updated_at": f.updated_at.timestamp()}


def findings_for(cluster_id: int, run_id: int | None) -> list[dict[str, Any]]:
    qs = Finding.objects.filter(cluster_id=cluster_id, state=Finding.State.OPEN).order_by("-updated_at")[:100]
    return [finding_row(f) for f in qs]
