"""The live websocket: ``/ws/live/?run=<id>`` or ``?cluster=<id>``.

connect = check the user may see it, join the groups, send a snapshot. Group events are merged into one pending
delta and each client gets at most one frame per ``LIVE_FRAME_INTERVAL_MS``, however fast ingest goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import parse_qs

import msgspec
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user_model

from dashboard.live import snapshot
from dashboard.live.broadcast import cluster_group, run_group
from dashboard.live.events import EVENT_KEYS, GPU_ROW, STEP_ROW
from dashboard.live.state import WATCH_TTL_S, get_state
from dashboard.telemetry.models import Cluster, Rank, Run

MAX_PENDING_STEPS = 20_000
MAX_PENDING_ROWS = 2_000  # events, and findings (one row per finding), held for one client between frames


@database_sync_to_async
def _resolve(user: Any, query: dict[str, list[str]]) -> tuple[Cluster, Run | None] | None:
    """The cluster (and run) a client asks for, when the user may see it; ``?node=HOST`` narrows a cluster stream to
    one node (its GPUs and events), so a node page does not receive 16,000 GPUs' deltas to throw away; ``?only=findings``
    (a comma list of event kinds) keeps just those kinds, for pages that follow findings only."""
    try:
        if "run" in query:
            run = Run.objects.select_related("cluster").get(id=int(query["run"][0]))
            cluster: Cluster = run.cluster
        else:
            run, cluster = None, Cluster.objects.get(id=int(query["cluster"][0]))
    except (KeyError, ValueError, Run.DoesNotExist, Cluster.DoesNotExist):
        return None
    return (cluster, run) if cluster.visible_to(user) else None


@database_sync_to_async
def _still_allowed(user_id: int, cluster_id: int) -> bool:
    """Read afresh: the user may have been removed from the cluster, deactivated or deleted since the socket opened."""
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    return user is not None and cluster is not None and cluster.visible_to(user)


def _run_hosts_now(run: Run) -> frozenset[str]:
    return frozenset(h for h in Rank.objects.filter(run=run).values_list("node__hostname", flat=True).distinct() if h)


_run_hosts = database_sync_to_async(_run_hosts_now)


@sync_to_async(thread_sensitive=False)
def _watch(run_id: int, watcher: str, on: bool) -> None:
    """Tell the publishers (every web worker's) that this socket watches the run's steps, for WATCH_TTL_S, or no
    longer: they build a run's step deltas only while someone does."""
    live = get_state()
    if on:
        live.watch_run(run_id, watcher, time.time() + WATCH_TTL_S)
    else:
        live.unwatch_run(run_id, watcher)


@database_sync_to_async
def _snapshot(cluster: Cluster, run: Run | None, host: str | None, only: set[str] | None,
              hosts: frozenset[str] | None = None) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "snapshot", "seq": 0, "columns": {"steps": STEP_ROW, "gpus": GPU_ROW}}
    if only is not None:
        if "findings" in only:
            frame["findings"] = snapshot.open_findings(cluster.id, run.id if run else None)
        if "events" in only:
            frame["events"] = snapshot.recent_events(cluster.id, run.id if run else None, host)
        return frame
    if run is not None:
        run.refresh_from_db()
        frame["run"] = snapshot.run_info(run)
        frame["steps"] = snapshot.recent_steps(run)
    gpus = snapshot.latest_gpus(cluster.id)
    frame["gpus"] = [g for g in gpus if g[0] == host] if host else [g for g in gpus if g[0] in hosts] \
        if hosts is not None else gpus
    # Events come from the database, so a reload shows the recent warnings instead of "No warnings." until a new one.
    frame["events"] = snapshot.recent_events(cluster.id, run.id if run else None, host)
    frame["findings"] = snapshot.open_findings(cluster.id, run.id if run else None)
    return frame


_encode = msgspec.json.Encoder().encode


class LiveConsumer(AsyncJsonWebsocketConsumer):
    @classmethod
    async def encode_json(cls, content: Any) -> str:
        # msgspec, not json.dumps: at 2,048 nodes a watching page's frames carry 16,384 GPU rows a second, and
        # json.dumps of them was a twentieth of the server's CPU with one page open. It also writes a NaN as null,
        # which the browser's JSON.parse accepts (json.dumps writes NaN, which it refuses).
        return _encode(content).decode()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        found = await _resolve(user, query)
        if found is None:
            await self.close(code=4404)
            return
        cluster, run = found
        self.host: str | None = (query.get("node") or [None])[0]
        # A run page draws only its own nodes' GPUs and events: a 128-node run in a 2,048-node cluster was sent all
        # 16,384 GPUs every frame (1.7 MB snapshots, ~300 KB a second) to throw away. Re-read at each access recheck,
        # so a rank that moves to another node brings that node's rows.
        self.run_hosts: frozenset[str] | None = await _run_hosts(run) if run is not None else None
        only = (query.get("only") or [""])[0]
        self.only: set[str] | None = {k for k in only.split(",") if k in EVENT_KEYS} if only else None
        self.user_id, self.cluster_id = user.pk, cluster.id
        # Before the snapshot is read: a group that commits after this is published with its steps, and one that
        # committed before it is in the snapshot.
        self.watching = run.id if run is not None and (self.only is None or "steps" in self.only) else None
        if self.watching is not None:
            await _watch(self.watching, self.channel_name, True)
        self.groups_joined = [cluster_group(cluster.id)] + ([run_group(run.id)] if run else [])
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        self.pending: dict[str, Any] = {}
        self.seq = 0
        await self.accept()
        await self.send_json(await _snapshot(cluster, run, self.host, self.only, self.run_hosts))
        self.run = run
        self.flusher = asyncio.create_task(self._flush_forever())

    async def disconnect(self, code: int) -> None:
        flusher = getattr(self, "flusher", None)
        if flusher is not None:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        if getattr(self, "watching", None) is not None:
            with contextlib.suppress(Exception):  # a Redis hiccup: the watch lapses on its own within WATCH_TTL_S
                await _watch(self.watching, self.channel_name, False)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any) -> None:
        """The stream is server to client only: a client's frame is dropped unread. (The JSON base class would parse
        it, and a frame that is not JSON raised out of the consumer, which skips ``disconnect``: the flusher task and
        the group memberships were left behind for every such socket.)"""

    async def live_event(self, message: dict[str, Any]) -> None:
        event = message["event"]
        kind = event["type"]
        if self.only is not None and kind not in self.only:
            return
        if self.host is not None and kind in ("gpus", "events"):
            key = 0 if kind == "gpus" else "host"
            rows = [r for r in event[kind] if r[key] == self.host]
            if not rows:
                return
            event = {**event, kind: rows}
        elif self.run_hosts is not None and kind in ("gpus", "events"):
            hosts = self.run_hosts
            rows = ([r for r in event[kind] if r[0] in hosts] if kind == "gpus"
                    else [r for r in event[kind] if not r.get("host") or r["host"] in hosts])
            if not rows:
                return
            event = {**event, kind: rows}
        if kind == "gpus":
            gpus = self.pending.setdefault("gpus", {})
            for row in event["gpus"]:
                gpus[(row[0], row[1])] = row  # latest per GPU wins: a delta, not a log
        elif kind == "steps":
            steps = self.pending.setdefault("steps", [])
            steps.extend(event["steps"])
            if len(steps) > MAX_PENDING_STEPS:  # a stalled client catches up with the recent past only
                del steps[: len(steps) - MAX_PENDING_STEPS]
        elif kind == "findings":
            findings = self.pending.setdefault("findings", {})
            for row in event["findings"]:
                findings.pop(row["id"], None)  # the latest state of each finding wins, in the order they changed
                findings[row["id"]] = row
            while len(findings) > MAX_PENDING_ROWS:  # a stalled client: the oldest changes go first
                del findings[next(iter(findings))]
        else:
            rows = self.pending.setdefault(kind, [])
            rows.extend(event[kind])
            if len(rows) > MAX_PENDING_ROWS:  # a stalled client catches up with the recent events only
                del rows[: len(rows) - MAX_PENDING_ROWS]

    async def _flush_forever(self) -> None:
        interval = settings.CLUSTERDX["LIVE_FRAME_INTERVAL_MS"] / 1000
        recheck = float(settings.CLUSTERDX["LIVE_ACCESS_RECHECK_S"])
        loop = asyncio.get_running_loop()
        next_check = loop.time() + recheck
        next_watch = loop.time() + WATCH_TTL_S / 3
        while True:
            await asyncio.sleep(interval)
            if self.watching is not None and loop.time() >= next_watch:
                next_watch = loop.time() + WATCH_TTL_S / 3
                with contextlib.suppress(Exception):  # tried again at the next third; lapses only after three misses
                    await _watch(self.watching, self.channel_name, True)
            if loop.time() >= next_check:
                # Access was checked at connect; a member removed since must not keep watching.
                next_check = loop.time() + recheck
                if not await _still_allowed(self.user_id, self.cluster_id):
                    self.pending = {}
                    await self.close(code=4403)
                    return
                if self.run is not None:
                    self.run_hosts = await _run_hosts(self.run)
            if not self.pending:
                continue
            pending, self.pending = self.pending, {}
            self.seq += 1
            frame: dict[str, Any] = {"type": "delta", "seq": self.seq}
            for key, value in pending.items():
                frame[key] = list(value.values()) if isinstance(value, dict) else value
            await self.send_json(frame)
