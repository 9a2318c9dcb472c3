"""The home page: the clusters you are a member of. Each page lives in :mod:`dashboard.web.pages`."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard.web.access import visible_clusters


def _health(cluster_ids: list[int]) -> dict[int, dict[str, Any]]:
    """One line per cluster, in two queries whatever the number of clusters: nodes, nodes silent past the heartbeat
    timeout, open findings and the worst of them."""
    from dashboard.diagnosis.detectors.base import SEVERITY_RANK
    from dashboard.diagnosis.models import Finding
    from dashboard.telemetry.models import Node

    cutoff = datetime.fromtimestamp(time.time() - float(settings.CLUSTERDX["HEARTBEAT_TIMEOUT_S"]), tz=UTC)
    out: dict[int, dict[str, Any]] = {c: {"nodes": 0, "silent": 0, "findings": 0, "worst": None} for c in cluster_ids}
    for row in (Node.objects.filter(cluster_id__in=cluster_ids).values("cluster_id")
                .annotate(n=Count("id"), silent=Count("id", filter=Q(last_seen__lt=cutoff) | Q(last_seen=None)))):
        out[row["cluster_id"]].update(nodes=row["n"], silent=row["silent"])
    for row in (Finding.objects.filter(cluster_id__in=cluster_ids, state=Finding.State.OPEN)
                .values("cluster_id", "severity").annotate(n=Count("id"))):
        h = out[row["cluster_id"]]
        h["findings"] += row["n"]
        if h["worst"] is None or SEVERITY_RANK[row["severity"]] > SEVERITY_RANK[h["worst"]]:
            h["worst"] = row["severity"]
    return out


@login_required
def home(request: HttpRequest) -> HttpResponse:
    clusters = list(visible_clusters(request.user).prefetch_related("runs").order_by("name"))
    health = _health([c.id for c in clusters])
    for c in clusters:
        c.health = health[c.id]  # type: ignore[attr-defined]
    return render(request, "web/home.html", {"clusters": clusters})
