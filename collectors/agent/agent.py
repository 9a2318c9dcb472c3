"""The agent's loop: every interval, ask each source, make a batch, spool it, wake the sender.

The loop keeps its own schedule (``next += interval; sleep(max(0, next - now))``) so that collection time does not
make the interval drift; after a stall longer than an interval (a suspended VM, a stuck source) it skips ahead
rather than firing a burst of catch-up samples.
"""

from __future__ import annotations

import logging
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
            self.sender.stop(STOP_GRACE_S)
            for status in self.statuses:
                registry.close(status)
            self.spool.close()

    def _tick_safely(self, now: float) -> None:
        try:
            self.tick(now)
        except Exception as exc:  # the spool's disk is full or gone: keep sampling, say it once per kind
            self.drops_total["spool_error"] = self.drops_total.get("spool_error", 0) + 1
            kind = type(exc).__name__
            if kind not in self._failed_sources:
                self._failed_sources.add(kind)
                log.exception("cannot spool this interval's batch (%s); it is lost, the agent carries on", exc)

    def tick(self, now: float) -> list[int]:
        """Collect one interval and spool it as one batch (or several, if it is too large); returns the seqs."""
        seqs = [self.spool.put(body, dropped) for body, dropped in self.batches(now)]
        self.batches_made += len(seqs)
        self.sender.wake()
        return seqs

    def batches(self, now: float) -> list[tuple[dict[str, Any], dict[str, int] | None]]:
        """One interval's batch bodies (without seq) and the drops the first one reports."""
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
