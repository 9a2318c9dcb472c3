"""The run page and a rank's page. (The run helper fills this in.)"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path

from dashboard.web.access import run_or_404


@login_required
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request.user, run_id)
    return render(request, "web/run.html", {"run": run, "cluster": run.cluster})


@login_required
def rank_detail(request: HttpRequest, run_id: int, rank: int) -> HttpResponse:
    raise Http404("not built yet")


urlpatterns: list[Any] = [
    path("runs/<int:run_id>/", run_detail, name="run"),
    path("runs/<int:run_id>/ranks/<int:rank>/", rank_detail, name="rank"),
]
OPENAPI: dict[str, Any] = {}
