"""Template context for every page."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.templatetags.static import static

PLOTLY_PATH = "vendor/plotly/plotly.min.js"
CARTESIAN_PATH = "vendor/plotly-cartesian/plotly-cartesian.min.js"


@cache
def _plotly_js() -> str:
    import plotly

    # The version in the URL: the file is then served as immutable (WHITENOISE_IMMUTABLE_FILE_TEST in settings), so a
    # browser keeps its 4.6 MB and its compiled code across pages instead of fetching it again every minute, and an
    # upgraded plotly is a new URL.
    return f"{static(PLOTLY_PATH)}?v={plotly.__version__}"


@cache
def _chart_js() -> tuple[str, bool]:
    """(URL, whether it draws WebGL traces) of the plotly the chart-first pages load: the cartesian bundle when
    installed (scripts/bootstrap.sh), else the full one. The cartesian bundle has no ``scattergl``: lib/chart.js draws
    those traces as SVG ``scatter`` (the server downsamples every series to a few thousand points)."""
    package = settings.PLOTLY_CARTESIAN_DIR / "package.json"
    if not package.is_file():
        return _plotly_js(), True
    version = json.loads(package.read_text())["version"]
    return f"{static(CARTESIAN_PATH)}?v={version}", False


def assets(request: HttpRequest) -> dict[str, Any]:
    chart_js, gl = _chart_js()
    return {"PLOTLY_JS": _plotly_js(), "PLOTLY_CHART_JS": chart_js, "PLOTLY_CHART_GL": gl}
