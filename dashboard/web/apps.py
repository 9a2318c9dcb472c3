from importlib import import_module
from typing import Any

from django.apps import AppConfig


class WebConfig(AppConfig):
    name = "dashboard.web"
    label = "web"

    def openapi_paths(self) -> dict[str, Any]:
        from dashboard.web.pages import PAGES

        paths: dict[str, Any] = {}
        for page in PAGES:
            paths.update(getattr(import_module(f"dashboard.web.pages.{page}"), "OPENAPI", {}))
        return paths
