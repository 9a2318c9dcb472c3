"""The Redis channel layer with a blocking pop shorter than redis-py's read timeout.

channels_redis waits for messages in ``BZPOPMIN`` for up to 5 s, and redis-py 8 gives every read a 5 s socket
timeout by default: a server whose event loop was a little late (under load) read the answer after the timeout and
the websocket application died with ``TimeoutError`` (no live updates at all; the ingest benchmark found it on
PostgreSQL + Redis). Here the pop returns within 2 s and the socket timeout (settings) leaves room past it.
"""

from __future__ import annotations

from channels_redis.core import RedisChannelLayer


class ChannelLayer(RedisChannelLayer):
    brpop_timeout = 2
