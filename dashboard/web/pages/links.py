"""The link matrix and one link's page. (The links helper fills this in.)"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import path


@login_required
def link_matrix(request: HttpRequest, name: str) -> HttpResponse:
    raise Http404("not built yet")


@login_required
def link_detail(request: HttpRequest, name: str, a: str, b: str) -> HttpResponse:
    raise Http404("not built yet")


urlpatterns: list[Any] = [
    path("clusters/<slug:name>/links/", link_matrix, name="links"),
    path("clusters/<slug:name>/links/<str:a>/<str:b>/", link_detail, name="link"),
]
OPENAPI: dict[str, Any] = {}
