from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from dashboard.api.openapi import document


@require_GET
def openapi(request: HttpRequest) -> JsonResponse:
    return JsonResponse(document(), json_dumps_params={"indent": None})
