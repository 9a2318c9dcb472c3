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
    """Send ``event`` to every browser in ``group``."""
    broadcast_all([(group, event)])


def broadcast_all(messages: list[tuple[str, dict[str, Any]]]) -> None:
    """Send each ``(group, event)`` to every browser in that group. Several messages travel in one hop to the event
    loop (ingest sends two or three per batch). Never raises: a live view is best effort, storage is not."""
    for _, event in messages:
        check_event(event)
    layer = get_channel_layer()
    if layer is None or not messages:
        return

    async def send_all() -> None:
        for group, event in messages:
            await layer.group_send(group, {"type": "live.event", "event": event})

    try:
        async_to_sync(send_all)()
    except Exception as exc:  # a full channel or a Redis hiccup must not fail the ingest that already committed
        log.warning("broadcast to %s failed: %s", [g for g, _ in messages], exc)

