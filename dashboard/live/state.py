"""Live state: the latest heartbeat per node, the latest sample per GPU and the latest beat per rank, per cluster.

Redis in production (shared by every ASGI and Celery worker), a dict in the embedded default. Small and bounded:
one entry per node and per GPU, overwritten in place.
"""

from __future__ import annotations

import json
import threading
import time
from functools import lru_cache
from typing import Any, Protocol

from django.conf import settings


class LiveState(Protocol):
    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None: ...

    def heartbeats(self, cluster_id: int) -> dict[str, float]: ...

    def gpus(self, cluster_id: int) -> list[list[Any]]: ...

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None: ...

    def beats(self, cluster_id: int) -> list[dict[str, Any]]: ...


def _beat_row(host: str, beat: dict[str, Any]) -> dict[str, Any]:
    return {**beat, "host": host, "received": time.time()}


class MemoryState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hb: dict[int, dict[str, float]] = {}
        self._gpus: dict[int, dict[tuple[str, int], list[Any]]] = {}
        self._beats: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}

    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None:
        with self._lock:
            self._hb.setdefault(cluster_id, {})[host] = time.time()
            table = self._gpus.setdefault(cluster_id, {})
            for row in gpus:
                table[(row[0], row[1])] = row

    def heartbeats(self, cluster_id: int) -> dict[str, float]:
        with self._lock:
            return dict(self._hb.get(cluster_id, {}))

    def gpus(self, cluster_id: int) -> list[list[Any]]:
        with self._lock:
            return list(self._gpus.get(cluster_id, {}).values())

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None:
        with self._lock:
            table = self._beats.setdefault(cluster_id, {})
            for beat in beats:
                table[(beat["run"], beat["rank"])] = _beat_row(host, beat)

    def beats(self, cluster_id: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._beats.get(cluster_id, {}).values())


class RedisState:
    def __init__(self, url: str, prefix: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(url)
        self._prefix = prefix

    def _key(self, what: str, cluster_id: int) -> str:
        return f"{self._prefix}:live:{what}:{cluster_id}"

    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self._key("hb", cluster_id), host, time.time())
        if gpus:
            pipe.hset(self._key("gpu", cluster_id), mapping={f"{r[0]}|{r[1]}": json.dumps(r) for r in gpus})
        pipe.execute()

    def heartbeats(self, cluster_id: int) -> dict[str, float]:
        raw = self._redis.hgetall(self._key("hb", cluster_id))
        return {k.decode(): float(v) for k, v in raw.items()}

    def gpus(self, cluster_id: int) -> list[list[Any]]:
        return [json.loads(v) for v in self._redis.hvals(self._key("gpu", cluster_id))]

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None:
        if beats:
            mapping = {f"{b['run']}|{b['rank']}": json.dumps(_beat_row(host, b)) for b in beats}
            self._redis.hset(self._key("beat", cluster_id), mapping=mapping)

    def beats(self, cluster_id: int) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self._redis.hvals(self._key("beat", cluster_id))]

    def clear(self) -> None:
        for key in self._redis.scan_iter(f"{self._prefix}:live:*"):
            self._redis.delete(key)


@lru_cache(maxsize=1)
def get_state() -> LiveState:
    if settings.REDIS_URL:
        import os

        return RedisState(settings.REDIS_URL, os.environ.get("CLUSTERDX_REDIS_PREFIX", "clusterdx"))
    return MemoryState()
