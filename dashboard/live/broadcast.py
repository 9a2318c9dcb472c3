"""The only way anything is pushed to browsers.

Producers (ingest, diagnosis) call :func:`broadcast` with a group and an event whose shape is declared in
:mod:`dashboard.live.events`; consumers merge events and send each client at most one frame per interval.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from dashboard.live.events import check_event

log = logging.getLogger(__name__)


def cluster_group(cluster_id: int) -> str:
    return f"cluster-{cluster_id}"


def run_group(run_id: int) -> str:
    return f"run-{run_id}"


def broadcast(group: str, event: dict[str, Any]) -> None:
    """Send ``event`` to every browser in ``group``. Never raises: a live view is best effort, storage is not."""
    check_event(event)
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, {"type": "live.event", "event": event})
    except Exception as exc:  # a full channel or a Redis hiccup must not fail the ingest that already committed
        log.warning("broadcast to %s failed: %s", group, exc)

