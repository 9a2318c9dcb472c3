"""Template context for every page."""

from __future__ import annotations

from functools import cache
from typing import Any

from django.http import HttpRequest
from django.templatetags.static import static

PLOTLY_PATH = "vendor/plotly/plotly.min.js"


@cache
def _plotly_js() -> str:
    import plotly

    # The version in the URL: the file is then served as immutable (WHITENOISE_IMMUTABLE_FILE_TEST in settings), so a
    # browser keeps its 4.6 MB and its compiled code across pages instead of fetching it again every minute, and an
    # upgraded plotly is a new URL.
    return f"{static(PLOTLY_PATH)}?v={plotly.__version__}"


def assets(request: HttpRequest) -> dict[str, Any]:
    return {"PLOTLY_JS": _plotly_js()}
