"""The node page and the GPU view. (The node helper fills this in.)"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import path


@login_required
def node_detail(request: HttpRequest, name: str, host: str) -> HttpResponse:
    raise Http404("not built yet")


@login_required
def gpu_detail(request: HttpRequest, name: str, host: str, index: int) -> HttpResponse:
    raise Http404("not built yet")


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/nodes/<str:host>/", node_detail, name="node"),
    path("clusters/<slug:name>/nodes/<str:host>/gpus/<int:index>/", gpu_detail, name="gpu"),
]
OPENAPI: dict[str, Any] = {}
