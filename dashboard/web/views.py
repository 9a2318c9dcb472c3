"""Pages. Everything is login-required and scoped to the clusters the user is a member of (404 otherwise, so an
outsider cannot even learn that a cluster or run exists)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from dashboard.telemetry.models import Cluster, Run


def visible_clusters(user: object) -> QuerySet[Cluster]:
    if getattr(user, "is_superuser", False):
        return Cluster.objects.all()
    return Cluster.objects.filter(members=user)


@login_required
def home(request: HttpRequest) -> HttpResponse:
    clusters = visible_clusters(request.user).prefetch_related("runs").order_by("name")
    return render(request, "web/home.html", {"clusters": clusters})


@login_required
def cluster_detail(request: HttpRequest, name: str) -> HttpResponse:
    cluster = get_object_or_404(visible_clusters(request.user), name=name)
    nodes = cluster.nodes.order_by("hostname")
    runs = cluster.runs.order_by("-last_step_at")
    return render(request, "web/cluster.html", {"cluster": cluster, "nodes": nodes, "runs": runs})


@login_required
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run.objects.select_related("cluster"), id=run_id)
    if not run.cluster.visible_to(request.user):
        raise Http404("no such run")
    return render(request, "web/run.html", {"run": run, "cluster": run.cluster})
