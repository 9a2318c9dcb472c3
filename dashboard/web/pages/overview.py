"""The cluster overview: health map, open findings, events, runs, search. (The overview helper fills this in.)"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path

from dashboard.web.access import cluster_or_404


@login_required
def cluster_detail(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_or_404(request.user, name)
    nodes = cluster.nodes.order_by("hostname")
    runs = cluster.runs.order_by("-last_step_at")
    return render(request, "web/cluster.html", {"cluster": cluster, "nodes": nodes, "runs": runs})


@login_required
def search(request: HttpRequest) -> HttpResponse:
    raise Http404("not built yet")


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/", cluster_detail, name="cluster"),
    path("search/", search, name="search"),
]
OPENAPI: dict[str, Any] = {}
