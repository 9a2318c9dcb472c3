"""The channel layers: Redis with a short blocking pop (production), and an in-process one that shares messages.

channels_redis waits for messages in ``BZPOPMIN`` for up to 5 s, and redis-py 8 gives every read a 5 s socket
timeout by default: a server whose event loop was a little late (under load) read the answer after the timeout and
the websocket application died with ``TimeoutError`` (no live updates at all; the ingest benchmark found it on
PostgreSQL + Redis). Here the pop returns within 2 s and the socket timeout (settings) leaves room past it.

The embedded server's layer is channels' in-memory one without its deep copy per receiving channel: every 250 ms the
merged GPU rows of the whole cluster (16,384 at 2,048 nodes) were copied once per watching browser, a thirtieth of the
server's time under the ingest benchmark. Messages are shared read-only instead: producers build each one fresh
(:mod:`dashboard.live.publish`) and never touch it again, and consumers (:class:`dashboard.live.consumers.LiveConsumer`)
build their own lists from it; tests/server/test_live_layer.py holds both to that.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer
from channels_redis.core import RedisChannelLayer


class ChannelLayer(RedisChannelLayer):
    brpop_timeout = 2


class LocalChannelLayer(InMemoryChannelLayer):
    """In one process: a message is put on each receiving channel's queue as it is, not deep-copied."""

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_channel_name(channel)
        assert "__asgi_channel__" not in message
        queue = self.channels.setdefault(channel, asyncio.Queue(maxsize=self.get_capacity(channel)))
        try:
            queue.put_nowait((time.time() + self.expiry, message))
        except asyncio.QueueFull as exc:
            raise ChannelFull(channel) from exc
