"""The local socket where training processes on this node drop their step records (``HookDatagram`` JSON).

A thread receives and validates datagrams into a bounded buffer, so a burst between two intervals neither blocks
the hooks (UDP never does) nor grows without limit; ``collect`` hands the buffer to the next batch. Bad datagrams
are counted as ``hook_bad_datagram`` and logged once per kind of mistake. The hooks' own drop counters are
cumulative per process, so the agent forwards their increase, by reason, prefixed ``hook_``.

Anything on the node can write to this socket, so a datagram is checked here as strictly as the server checks a
batch: one that the server would refuse (a lone surrogate, an integer beyond its column, a time far ahead of the
clock this node shares with its hooks) would cost the agent's whole batch, GPU samples included. A datagram may
carry only the events a training process reports (``wire.HOOK_EVENT_KINDS``): an Xid or kernel event from it would
speak for the node, and page the on-call, with the agent's own authority.

It listens on loopback by default and takes datagrams only from loopback sources: Linux delivers a datagram sent
from another address to 127.0.0.1 (from the node's own addresses always, and from the network where
``route_localnet`` is set, as kube-proxy does). A non-loopback address (``0.0.0.0`` for pods that are not on the
host network) takes ``allow_remote = true``: then anyone who reaches the port can send, so firewall it.
"""

from __future__ import annotations

import ipaddress
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as parse_addr returns it, or 'localhost') is the node's loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: it resolves to who knows what, so it is not trusted as loopback
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _check_events(gram: dict[str, Any]) -> None:
    for i, event in enumerate(gram["events"]):
        if event["kind"] not in wire.HOOK_EVENT_KINDS:
            raise wire.WireError(f"events[{i}].kind", f"{event['kind']!r} is not a training process's event "
                                                      f"(only {', '.join(wire.HOOK_EVENT_KINDS)})")


def _check_clock(gram: dict[str, Any], now: float) -> None:
    for path, ts in wire.timestamps(wire.HookDatagram, gram):
        if ts > now + wire.MAX_FUTURE_S:
            raise wire.WireError(path, f"{ts - now:.0f} s ahead of this node's clock (limit {wire.MAX_FUTURE_S:g} s)")


class HookSource:
    name = "hooks"

    def __init__(self, *, addr: str = "{}:{}".format(*wire.LOCAL_HOOK_ADDR), max_steps: int = 10_000,
                 max_events: int = 5_000, max_runs: int = 512, max_beats: int = 4_096,
                 allow_remote: bool = False) -> None:
        self.addr = parse_addr(addr)
        self.allow_remote = allow_remote
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
        if not is_loopback(self.addr[0]):
            if not self.allow_remote:
                return f"{self.addr[0]} is not a loopback address; set allow_remote = true to listen on it"
            log.warning("the hook socket listens on %s (allow_remote = true): anyone who reaches udp port %d can "
                        "send records as this node's training jobs; firewall it", self.addr[0], self.addr[1])
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
                data, peer = self._sock.recvfrom(wire.MAX_DATAGRAM_BYTES + 1)
            except TimeoutError:
                continue
            except OSError:
                return
            self.accept(data, peer)

    def accept(self, data: bytes, peer: tuple[Any, ...] | None = None) -> None:
        """Validate one datagram from ``peer`` (None: in-process) and buffer its records (public so tests can feed
        it without a socket)."""
        if peer is not None and not self.allow_remote and not is_loopback(str(peer[0])):
            with self._lock:
                first = "remote" not in self._logged
                self._logged.add("remote")
                self._count("hook_remote_refused", 1)
            if first:
                log.warning("refused a datagram from %s on the hook socket (only this node's loopback may send; "
                            "allow_remote = true to take others); further ones are only counted", peer[0])
            return
        try:
            if len(data) > wire.MAX_DATAGRAM_BYTES:
                raise wire.WireError("", f"datagram larger than {wire.MAX_DATAGRAM_BYTES} bytes")
            gram = wire.validate(wire.HookDatagram, json.loads(data))
            _check_clock(gram, time.time())
            _check_events(gram)
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
