"""The local socket where training processes on this node drop their step records (``HookDatagram`` JSON).

A thread receives and validates datagrams into a bounded buffer, so a burst between two intervals neither blocks
the hooks (UDP never does) nor grows without limit; ``collect`` hands the buffer to the next batch. Bad datagrams
are counted as ``hook_bad_datagram`` and logged once per kind of mistake. The hooks' own drop counters are
cumulative per process, so the agent forwards their increase, by reason, prefixed ``hook_``.

Anything on the node can write to this socket, so a datagram is checked here as strictly as the server checks a
batch: one that the server would refuse (a lone surrogate, an integer beyond its column, a time far ahead of the
clock this node shares with its hooks) would cost the agent's whole batch, GPU samples included.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from clusterdx import wire
from collectors.agent.source import Collected

log = logging.getLogger("clusterdx.agent.hooks")

_KINDS = ("steps", "runs", "events", "beats")
MAX_PROCESSES = 4096  # (host, pid) pairs whose cumulative drop counters are remembered


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _check_clock(gram: dict[str, Any], now: float) -> None:
    for path, ts in wire.timestamps(wire.HookDatagram, gram):
        if ts > now + wire.MAX_FUTURE_S:
            raise wire.WireError(path, f"{ts - now:.0f} s ahead of this node's clock (limit {wire.MAX_FUTURE_S:g} s)")


class HookSource:
    name = "hooks"

    def __init__(self, *, addr: str = "{}:{}".format(*wire.LOCAL_HOOK_ADDR), max_steps: int = 10_000,
                 max_events: int = 5_000, max_runs: int = 512, max_beats: int = 4_096) -> None:
        self.addr = parse_addr(addr)
        self.limits = {"steps": max_steps, "events": max_events, "runs": max_runs, "beats": max_beats}
        self.detail = ""
        self.received = dict.fromkeys(_KINDS, 0)  # forwarded records, by kind, since start (for /metrics)
        self._lock = threading.Lock()
        self._buf: dict[str, list[dict[str, Any]]] = {k: [] for k in _KINDS}
        self._dropped: dict[str, int] = {}
        self._hook_totals: OrderedDict[tuple[str, int], dict[str, int]] = OrderedDict()
        self._logged: set[str] = set()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> str | None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(self.addr)
        except OSError as exc:
            sock.close()
            return f"cannot listen on udp {self.addr[0]}:{self.addr[1]} ({exc.strerror})"
        sock.settimeout(0.5)  # lets close() stop the thread promptly
        self._sock = sock
        self.addr = sock.getsockname()[:2]
        self.detail = f"udp {self.addr[0]}:{self.addr[1]}"
        self._thread = threading.Thread(target=self._run, name="clusterdx-hooks", daemon=True)
        self._thread.start()
        return None

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data = self._sock.recv(wire.MAX_DATAGRAM_BYTES + 1)
            except TimeoutError:
                continue
            except OSError:
                return
            self.accept(data)

    def accept(self, data: bytes) -> None:
        """Validate one datagram and buffer its records (public so tests can feed it without a socket)."""
        try:
            if len(data) > wire.MAX_DATAGRAM_BYTES:
                raise wire.WireError("", f"datagram larger than {wire.MAX_DATAGRAM_BYTES} bytes")
            gram = wire.validate(wire.HookDatagram, json.loads(data))
            _check_clock(gram, time.time())
        except ValueError as exc:  # json.JSONDecodeError and wire.WireError are both ValueErrors
            self._bad(exc)
            return
        with self._lock:
            for kind in _KINDS:
                self._take(kind, gram[kind])
            self._hook_drops(gram["host"], gram["pid"], gram["dropped"] or {})

    def _take(self, kind: str, records: list[dict[str, Any]]) -> None:
        room = self.limits[kind] - len(self._buf[kind])
        if len(records) > room:
            self._count("hook_buffer_full", len(records) - max(room, 0))
            records = records[: max(room, 0)]
        # Validation filled every default in; forward only what the hook sent, to keep batches small.
        self._buf[kind].extend({k: v for k, v in r.items() if v is not None} for r in records)
        self.received[kind] += len(records)

    def _hook_drops(self, host: str, pid: int, totals: dict[str, int]) -> None:
        key = (host, pid)
        before = self._hook_totals.pop(key, {})
        self._hook_totals[key] = totals
        if len(self._hook_totals) > MAX_PROCESSES:
            self._hook_totals.popitem(last=False)
        for reason, total in totals.items():
            # A restarted process with a reused pid starts again from 0: then the whole count is new.
            increase = total - before.get(reason, 0) if total >= before.get(reason, 0) else total
            if increase:
                self._count(reason if reason.startswith("hook") else f"hook_{reason}", increase)

    def _count(self, reason: str, n: int) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + n

    def _bad(self, exc: ValueError) -> None:
        path = getattr(exc, "path", None)
        kind = "not JSON" if path is None else re.sub(r"\[\d+\]", "[]", path) or "datagram"
        with self._lock:
            self._count("hook_bad_datagram", 1)
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("bad datagram on the hook socket (%s): %s; further ones like it are only counted", kind, exc)

    def collect(self, now: float, out: Collected) -> None:
        with self._lock:
            buf, self._buf = self._buf, {k: [] for k in _KINDS}
            dropped, self._dropped = self._dropped, {}
        out.steps.extend(buf["steps"])
        out.runs.extend(buf["runs"])
        out.events.extend(buf["events"])
        # Only each rank's latest beat matters: it says where the rank is now.
        latest: dict[tuple[str, int], dict[str, Any]] = {}
        for beat in buf["beats"]:
            latest[(beat["run"], beat["rank"])] = beat
        out.beats.extend(latest.values())
        for reason, n in dropped.items():
            out.dropped[reason] = out.dropped.get(reason, 0) + n

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
