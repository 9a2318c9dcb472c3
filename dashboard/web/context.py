"""Template context for every page."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.templatetags.static import static

PLOTLY_PATH = "vendor/plotly/plotly.min.js"
CARTESIAN_PATH = "vendor/plotly-cartesian/plotly-cartesian.min.js"
BASIC_PATH = "vendor/plotly-basic/plotly-basic.min.js"


@cache
def _plotly_js() -> str:
    import plotly

    # The version in the URL: the file is then served as immutable (WHITENOISE_IMMUTABLE_FILE_TEST in settings), so a
    # browser keeps its 4.6 MB and its compiled code across pages instead of fetching it again every minute, and an
    # upgraded plotly is a new URL.
    return f"{static(PLOTLY_PATH)}?v={plotly.__version__}"


def _npm_bundle(package_dir: Path, path: str) -> str | None:
    """The URL (its version in the query: immutable) of a plotly bundle that scripts/bootstrap.sh installed, or None."""
    package = package_dir / "package.json"
    if not package.is_file():
        return None
    return f"{static(path)}?v={json.loads(package.read_text())['version']}"


@cache
def _chart_js() -> tuple[str, bool]:
    """(URL, whether it draws WebGL traces) of the plotly the chart-first pages with heatmaps load: the cartesian bundle
    when installed (scripts/bootstrap.sh), else the full one. The cartesian bundle has no ``scattergl``: lib/chart.js
    draws those traces as SVG ``scatter`` (the server downsamples every series to a few thousand points)."""
    url = _npm_bundle(settings.PLOTLY_CARTESIAN_DIR, CARTESIAN_PATH)
    return (url, False) if url else (_plotly_js(), True)


@cache
def _basic_js() -> tuple[str, bool]:
    """The same for the pages that draw only lines and bars: plotly's basic bundle (evaluated in half the cartesian
    one's time in Chromium here: 0.46-0.50 s against 0.92-1.02 s), else the cartesian one, else the full one."""
    url = _npm_bundle(settings.PLOTLY_BASIC_DIR, BASIC_PATH)
    return (url, False) if url else _chart_js()


def assets(request: HttpRequest) -> dict[str, Any]:
    chart_js, gl = _chart_js()
    basic_js, basic_gl = _basic_js()
    return {"PLOTLY_JS": _plotly_js(), "PLOTLY_CHART_JS": chart_js, "PLOTLY_CHART_GL": gl,
            "PLOTLY_BASIC_JS": basic_js, "PLOTLY_BASIC_GL": basic_gl}
