"""ASGI entry point: HTTP through Django (behind a request body limit), websockets through Channels (authenticated
like the pages), and the lifespan protocol, which starts the embedded scheduler when there is no Celery beat (no REDIS_URL)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from dashboard.ingest import asgi as ingest_asgi  # noqa: E402
from dashboard.live.routing import websocket_urlpatterns  # noqa: E402
from dashboard.scheduler import lifespan  # noqa: E402
from dashboard.security import BodyLimit  # noqa: E402

router = ProtocolTypeRouter(
    {
        # Django reads a whole body before it routes: the limit goes in front of it.
        "http": BodyLimit(django_asgi),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(scope, receive, send)
    elif scope["type"] == "http" and scope["path"] == ingest_asgi.PATH:
        await ingest_asgi.app(scope, receive, send)
    else:
        await router(scope, receive, send)
