"""The finding page and the findings list. (The finding helper fills this in.)"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import path


@login_required
def finding_detail(request: HttpRequest, finding_id: int) -> HttpResponse:
    raise Http404("not built yet")


@login_required
def finding_list(request: HttpRequest, name: str) -> HttpResponse:
    raise Http404("not built yet")


urlpatterns: list[Any] = [
    path("findings/<int:finding_id>/", finding_detail, name="finding"),
    path("clusters/<slug:name>/findings/", finding_list, name="findings"),
]
OPENAPI: dict[str, Any] = {}
