"""Live state: the latest heartbeat per node, the latest sample per GPU and the latest beat per rank, per cluster.

Redis in production (shared by every ASGI and Celery worker), a dict in the embedded default. Small and bounded:
one entry per node and per GPU, overwritten in place. Rank beats come and go with runs (every run brings new
(run, rank) keys), so they are trimmed: beats older than ``BEAT_TTL_S`` go, and at most ``MAX_BEATS`` per cluster
are kept (the least recently heard go first). And which runs a browser watches now: the publisher builds a run's
step deltas only then.
"""

from __future__ import annotations

import threading
import time
from functools import lru_cache
from typing import Any, Protocol

import msgspec
from django.conf import settings
from hiredis import pack_command as _pack  # redis[hiredis], a dependency: the C reply parser, and this (RedisState._send)

# The hang detector ignores runs stalled for an hour or more, so an older beat never names anything; kept a little
# longer than that. The bound is far above any real job's ranks: it only caps a flood of invented (run, rank) keys.
BEAT_TTL_S = 7200.0
MAX_BEATS = 65_536
TRIM_EVERY_S = 10.0  # Redis: trim at most this often per cluster and process (reads filter on their own)
# A run page's socket says it watches its run for this long and says it again every third of it (the consumer); a
# worker that dies without saying goodbye leaves its sockets' watches to lapse.
WATCH_TTL_S = 60.0


class LiveState(Protocol):
    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None: ...

    def record_hosts(self, cluster_id: int, hosts: dict[str, list[list[Any]]]) -> None: ...

    def heartbeats(self, cluster_id: int) -> dict[str, float]: ...

    def gpus(self, cluster_id: int) -> list[list[Any]]: ...

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None: ...

    def record_beats_hosts(self, cluster_id: int, by_host: dict[str, list[dict[str, Any]]]) -> None: ...

    def beats(self, cluster_id: int) -> list[dict[str, Any]]: ...

    def watch_run(self, run_id: int, watcher: str, until: float) -> None: ...

    def unwatch_run(self, run_id: int, watcher: str) -> None: ...

    def watched_runs(self) -> set[int]: ...


def _beat_row(host: str, beat: dict[str, Any], received: float) -> dict[str, Any]:
    return {**beat, "host": host, "received": received}


def _fresh(rows: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    return [r for r in rows if r["received"] >= now - BEAT_TTL_S]


class MemoryState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hb: dict[int, dict[str, float]] = {}
        self._gpus: dict[int, dict[tuple[str, int], list[Any]]] = {}
        self._beats: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}
        self._watched: dict[tuple[int, str], float] = {}  # (run id, watcher) -> until when, time.time()

    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None:
        with self._lock:
            self._hb.setdefault(cluster_id, {})[host] = time.time()
            table = self._gpus.setdefault(cluster_id, {})
            for row in gpus:
                table[(row[0], row[1])] = row

    def record_hosts(self, cluster_id: int, hosts: dict[str, list[list[Any]]]) -> None:
        for host, gpus in hosts.items():
            self.record(cluster_id, host, gpus)

    def heartbeats(self, cluster_id: int) -> dict[str, float]:
        with self._lock:
            return dict(self._hb.get(cluster_id, {}))

    def gpus(self, cluster_id: int) -> list[list[Any]]:
        with self._lock:
            return list(self._gpus.get(cluster_id, {}).values())

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None:
        now = time.time()
        with self._lock:
            table = self._beats.setdefault(cluster_id, {})
            for beat in beats:
                key = (beat["run"], beat["rank"])
                table.pop(key, None)  # re-inserted at the end: the dict stays in the order beats were heard
                table[key] = _beat_row(host, beat, now)
            # The least recently heard are in front: trimming costs only what it removes.
            while table and (len(table) > MAX_BEATS or next(iter(table.values()))["received"] < now - BEAT_TTL_S):
                del table[next(iter(table))]

    def record_beats_hosts(self, cluster_id: int, by_host: dict[str, list[dict[str, Any]]]) -> None:
        for host, beats in by_host.items():
            self.record_beats(cluster_id, host, beats)

    def beats(self, cluster_id: int) -> list[dict[str, Any]]:
        with self._lock:
            return _fresh(list(self._beats.get(cluster_id, {}).values()), time.time())

    def watch_run(self, run_id: int, watcher: str, until: float) -> None:
        with self._lock:
            self._watched[(run_id, watcher)] = until

    def unwatch_run(self, run_id: int, watcher: str) -> None:
        with self._lock:
            self._watched.pop((run_id, watcher), None)

    def watched_runs(self) -> set[int]:
        now = time.time()
        with self._lock:
            for key in [k for k, until in self._watched.items() if until < now]:
                del self._watched[key]
            return {run_id for run_id, _ in self._watched}


# KEYS: the beats hash, its heard-at sorted set; ARGV: cutoff, bound. Atomic, so two processes trimming at once
# cannot remove a beat heard meanwhile. Removes the stale, then the least recently heard beyond the bound.
_TRIM_BEATS = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1])
local over = redis.call('ZCARD', KEYS[2]) - #gone - tonumber(ARGV[2])
if over > 0 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[2], #gone, #gone + over - 1)) do table.insert(gone, m) end
end
for i = 1, #gone, 1000 do
  local part = {unpack(gone, i, math.min(i + 999, #gone))}
  redis.call('HDEL', KEYS[1], unpack(part))
  redis.call('ZREM', KEYS[2], unpack(part))
end
return #gone
"""


# Every GPU row and beat of every batch is encoded here: msgspec writes the same JSON as json.dumps in a fraction of
# its time (json.dumps was a tenth of the server's CPU at 256 nodes).
_encode = msgspec.json.Encoder().encode
# ... and read back by msgspec too: the diagnosis pass reads every rank's beat (16,384 at 2,048 nodes) each pass, and
# json.loads of them was 113 ms of a pass against 21 ms.
_decode = msgspec.json.Decoder().decode


class RedisState:
    def __init__(self, url: str, prefix: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(url)
        self._prefix = prefix
        self._trimmed: dict[int, float] = {}
        self._trim = self._redis.register_script(_TRIM_BEATS)
        self._watched_key = f"{prefix}:live:watched"  # one for all clusters: run ids are unique

    def _key(self, what: str, cluster_id: int) -> str:
        return f"{self._prefix}:live:{what}:{cluster_id}"

    def record(self, cluster_id: int, host: str, gpus: list[list[Any]]) -> None:
        self.record_hosts(cluster_id, {host: gpus})

    def _send(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Several commands in one round trip, as a pipeline does, but packed by hiredis in C. A pipeline encodes every
        argument in Python (a call and a few type checks each) and a committed group's GPU rows and beats are ~600 of
        them: that was ~a quarter of publishing the group. Arguments are str, bytes, int or float. A dropped
        connection is retried as the client's own commands are (its ``retry``), so a Redis restart costs no more
        than it did."""
        data = b"".join(map(_pack, commands))
        pool = self._redis.connection_pool
        conn = pool.get_connection()

        def exchange() -> list[Any]:
            conn.send_packed_command([data])
            return [conn.read_response() for _ in commands]

        try:
            return conn.retry.call_with_retry(exchange, lambda _: conn.disconnect())
        except BaseException:
            conn.disconnect()  # replies may be left unread on it: never hand it to the next caller as it is
            raise
        finally:
            pool.release(conn)

    def record_hosts(self, cluster_id: int, hosts: dict[str, list[list[Any]]]) -> None:
        """Every host of a committed ingest group in one round trip."""
        now = time.time()
        beat = ["HSET", self._key("hb", cluster_id)]
        for host in hosts:
            beat += (host, now)
        rows = ["HSET", self._key("gpu", cluster_id)]
        for gpus in hosts.values():
            for r in gpus:
                rows += (f"{r[0]}|{r[1]}", _encode(r))
        self._send(tuple(beat), *([tuple(rows)] if len(rows) > 2 else []))

    def heartbeats(self, cluster_id: int) -> dict[str, float]:
        raw = self._redis.hgetall(self._key("hb", cluster_id))
        return {k.decode(): float(v) for k, v in raw.items()}

    def gpus(self, cluster_id: int) -> list[list[Any]]:
        return [_decode(v) for v in self._redis.hvals(self._key("gpu", cluster_id))]

    def record_beats(self, cluster_id: int, host: str, beats: list[dict[str, Any]]) -> None:
        self.record_beats_hosts(cluster_id, {host: beats})

    def record_beats_hosts(self, cluster_id: int, by_host: dict[str, list[dict[str, Any]]]) -> None:
        """The beats in a hash, and when each was heard in a sorted set beside it, which the trim reads; every host of
        a committed ingest group in one round trip."""
        if not any(by_host.values()):
            return
        now = time.time()
        rows, heard = self._key("beat", cluster_id), self._key("beatt", cluster_id)
        keys = {f"{b['run']}|{b['rank']}": _encode(_beat_row(host, b, now))
                for host, beats in by_host.items() for b in beats}
        hset: list[Any] = ["HSET", rows]
        zadd: list[Any] = ["ZADD", heard]
        for key, row in keys.items():
            hset += (key, row)
            zadd += (now, key)
        # a cluster that goes quiet altogether leaves nothing behind
        self._send(tuple(hset), tuple(zadd), ("EXPIRE", rows, int(BEAT_TTL_S)), ("EXPIRE", heard, int(BEAT_TTL_S)))
        if now - self._trimmed.get(cluster_id, 0.0) >= TRIM_EVERY_S:
            self._trimmed[cluster_id] = now
            self._trim(keys=[rows, heard], args=[now - BEAT_TTL_S, MAX_BEATS])

    def beats(self, cluster_id: int) -> list[dict[str, Any]]:
        return _fresh([_decode(v) for v in self._redis.hvals(self._key("beat", cluster_id))], time.time())

    def watch_run(self, run_id: int, watcher: str, until: float) -> None:
        """A sorted set of ``run|watcher`` by until when: every web worker's publisher reads it, whichever worker
        holds the socket."""
        key = self._watched_key
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(key, {f"{run_id}|{watcher}": until})
        pipe.zremrangebyscore(key, "-inf", f"({time.time()}")
        pipe.expire(key, int(WATCH_TTL_S * 2))
        pipe.execute()

    def unwatch_run(self, run_id: int, watcher: str) -> None:
        self._redis.zrem(self._watched_key, f"{run_id}|{watcher}")

    def watched_runs(self) -> set[int]:
        members = self._redis.zrangebyscore(self._watched_key, time.time(), "+inf")
        return {int(m.split(b"|", 1)[0]) for m in members}

    def clear(self) -> None:
        for key in self._redis.scan_iter(f"{self._prefix}:live:*"):
            self._redis.delete(key)


@lru_cache(maxsize=1)
def get_state() -> LiveState:
    if settings.REDIS_URL:
        import os

        return RedisState(settings.REDIS_URL, os.environ.get("CLUSTERDX_REDIS_PREFIX", "clusterdx"))
    return MemoryState()
