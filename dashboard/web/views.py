"""The home page: the clusters you are a member of. Each page lives in :mod:`dashboard.web.pages`."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard.web.access import visible_clusters


@login_required
def home(request: HttpRequest) -> HttpResponse:
    clusters = visible_clusters(request.user).prefetch_related("runs").order_by("name")
    return render(request, "web/home.html", {"clusters": clusters})
