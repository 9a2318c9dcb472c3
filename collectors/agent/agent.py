"""The agent's loop: every interval, ask each source, make a batch, spool it, wake the sender.

It samples every ``interval_s`` but posts at most once per *send interval*: the larger of its own ``send_interval_s``
and the ``send_interval_s`` the server last advertised (a large cluster's server asks for fewer, larger posts). In
between, each interval's records are staged in the spool, and once per send interval they are sealed into one batch
(or several, if too large) whose records keep their own ``ts``.

The loop keeps its own schedule (``next += interval; sleep(max(0, next - now))``) so that collection time does not
make the interval drift; after a stall longer than an interval (a suspended VM, a stuck source) it skips ahead
rather than firing a burst of catch-up samples.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Any

from clusterdx import wire
from collectors.agent import batch as batches
from collectors.agent import registry
from collectors.agent.config import AgentConfig, read_token
from collectors.agent.delivery import Backoff, Poster, Sender
from collectors.agent.source import Collected
from collectors.agent.spool import Spool

log = logging.getLogger("clusterdx.agent")

STOP_GRACE_S = 2.0


class Agent:
    def __init__(self, cfg: AgentConfig, statuses: list[registry.Status], spool: Spool) -> None:
        self.cfg = cfg
        self.statuses = statuses
        self.sources = [s.source for s in statuses if s.source is not None]
        self.spool = spool
        poster = Poster(cfg.server, lambda: read_token(cfg.token_file), timeout=cfg.http_timeout_s,
                        ca_file=cfg.ca_file)
        self.sender = Sender(spool, poster, Backoff(cfg.backoff_initial_s, cfg.backoff_max_s))
        self.checker = batches.Checker()
        self.stop_event = threading.Event()
        # What /metrics shows: the last interval's records and running totals.
        self.last: Collected = Collected()
        self.drops_total: dict[str, int] = {}
        self.source_errors: dict[str, int] = {}
        self.batches_made = 0
        self.last_xid: dict[int, int] = {}  # GPU index -> last Xid code, as DCGM_FI_DEV_XID_ERRORS shows it
        self._failed_sources: set[str] = set()
        self._sealed_at = -math.inf  # monotonic time of the last seal; the first interval is sent at once

    def run(self) -> None:
        self.sender.start()
        interval = self.cfg.interval_s
        next_t = time.monotonic()
        try:
            while not self.stop_event.is_set():
                self._tick_safely(time.time())
                next_t += interval
                now = time.monotonic()
                if now - next_t > interval:
                    next_t = now  # fell behind by more than an interval: skip, do not burst
                self.stop_event.wait(max(0.0, next_t - now))
        finally:
            self._seal_rest()
            self.sender.stop(STOP_GRACE_S)
            for status in self.statuses:
                registry.close(status)
            self.spool.close()

    def _seal_rest(self) -> None:
        # On a clean stop the staged intervals go out now (or wait sealed in the spool) rather than at the next start.
        if self.spool.staged:
            with contextlib.suppress(Exception):  # they stay staged, and the next start seals them
                self.seal(time.time())

    def _tick_safely(self, now: float) -> None:
        try:
            self.tick(now)
        except Exception as exc:  # the spool's disk is full or gone: keep sampling, say it once per kind
            self.drops_total["spool_error"] = self.drops_total.get("spool_error", 0) + 1
            kind = type(exc).__name__
            if kind not in self._failed_sources:
                self._failed_sources.add(kind)
                log.exception("cannot spool this interval's batch (%s); it is lost, the agent carries on", exc)

    def send_interval_s(self) -> float:
        """The minimum time between two posts: the agent's own setting or the server's advert, whichever is larger."""
        return max(self.cfg.interval_s, self.cfg.send_interval_s, self.sender.advised_interval_s or 0.0)

    def tick(self, now: float) -> list[int]:
        """Collect one interval; stage it, or, once per send interval, seal it with the staged ones into one batch
        (or several, if too large). Returns the seqs sealed (none while staging)."""
        lists, dropped = self.records(now)
        clock = time.monotonic()
        # Half an interval of slack: ticks fall on the interval grid, and a tick a few ms early must not wait a whole
        # interval more.
        if clock - self._sealed_at < self.send_interval_s() - self.cfg.interval_s / 2:
            self.spool.stage(lists, dropped)
            return []
        return self.seal(now, lists, dropped, clock)

    def seal(self, now: float, lists: dict[str, list[dict[str, Any]]] | None = None,
             dropped: dict[str, int] | None = None, clock: float | None = None) -> list[int]:
        """Seal the staged intervals (and ``lists``) into numbered batches and wake the sender."""
        seqs = self.spool.seal(lists or {}, lambda merged: [body for body, _ in self.bodies(now, merged)], dropped)
        self._sealed_at = time.monotonic() if clock is None else clock
        self.batches_made += len(seqs)
        self.sender.wake()
        return seqs

    def batches(self, now: float) -> list[tuple[dict[str, Any], dict[str, int] | None]]:
        """One interval's batch bodies (without seq) and the drops the first one reports."""
        lists, dropped = self.records(now)
        return self.bodies(now, lists, dropped)

    def records(self, now: float) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
        """One interval's valid records by list, and the drops counted while collecting them."""
        collected = Collected()
        for source in self.sources:
            self._collect(source, now, collected)
        dropped = dict(collected.dropped)
        lists = self.checker.records(collected, dropped)
        self.last = collected
        for event in collected.events:
            if event.get("kind") == "xid" and event.get("gpu_index") is not None and event.get("code") is not None:
                self.last_xid[event["gpu_index"]] = event["code"]
        for reason, n in dropped.items():
            self.drops_total[reason] = self.drops_total.get(reason, 0) + n
        return lists, dropped

    def bodies(self, now: float, lists: dict[str, list[dict[str, Any]]], dropped: dict[str, int] | None = None,
               ) -> list[tuple[dict[str, Any], dict[str, int] | None]]:
        """Record lists as batch bodies (without seq) within the wire's bounds; the first reports ``dropped``."""
        head: dict[str, Any] = {"v": wire.WIRE_VERSION, "agent_id": self.cfg.agent_id, "host": self.cfg.host,
                                "sent_at": now}
        if self.cfg.topology:  # in every batch: small, and the server writes only a change
            head["topology"] = dict(self.cfg.topology)
        parts = batches.split(lists) or [{}]
        return [({**head, **{k: v for k, v in part.items() if v}}, dropped if i == 0 else None)
                for i, part in enumerate(parts)]

    def _collect(self, source: Any, now: float, out: Collected) -> None:
        try:
            source.collect(now, out)
        except Exception:
            # A source bug costs that source's records for this interval, never the loop.
            name = getattr(source, "name", type(source).__name__)
            self.source_errors[name] = self.source_errors.get(name, 0) + 1
            out.dropped["source_error"] = out.dropped.get("source_error", 0) + 1
            if name not in self._failed_sources:
                self._failed_sources.add(name)
                log.exception("source %s failed while collecting; it stays on, further failures are counted", name)

    def stop(self) -> None:
        self.stop_event.set()
