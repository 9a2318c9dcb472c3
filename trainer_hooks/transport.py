"""Getting records out of the training process without ever slowing it down or raising into it.

The training thread only appends to a bounded deque (a full queue drops the record and counts it). A daemon thread
wakes every ``interval`` seconds and ships what is queued:

* to the node agent, as :class:`clusterdx.wire.HookDatagram` JSON datagrams over UDP (``LOCAL_HOOK_ADDR`` or
  ``CLUSTERDX_AGENT_ADDR=host:port``). The socket is connected, so on the local host a missing agent shows up as
  ``ECONNREFUSED`` (ICMP port unreachable) right after the send;
* when no agent listens (or ``mode="server"``), straight to ``$CLUSTERDX_SERVER/api/v1/ingest`` as
  :class:`clusterdx.wire.Batch` objects under a per-process ``agent_id`` with increasing ``seq``. 4xx answers are
  permanent (drop, count, warn once with the server's reason); 5xx, 429 and connection errors are retried a bounded
  number of times with the same ``seq`` (the server is idempotent on it), then dropped and counted.

Drop counts are cumulative since the process started, by reason, and travel in every datagram or batch.

Fork: a DataLoader worker (or any fork) inherits the queue but not the thread; the child turns its copy off so
it neither ships the parent's records twice nor touches locks the parent's thread may have held. Exit: an atexit
handler flushes what is queued with a short, bounded timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import gzip
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from clusterdx import wire
from trainer_hooks.meta import ident

log = logging.getLogger("trainer_hooks")

KINDS = ("steps", "runs", "events", "beats")
Encoded = list[tuple[str, bytes]]  # (kind, one record's JSON)
_PER_DATAGRAM = {"steps": 1000, "runs": 64, "events": 1000, "beats": 64}  # HookDatagram list bounds
_PER_BATCH = {"steps": 20_000, "runs": 1024, "events": 10_000, "beats": 4096}  # Batch list bounds
_PER_TAKE = 5000
_HEAD_RESERVE = 2048  # envelope, list keys and the drop counts around the records
_DATAGRAM_BUDGET = wire.MAX_DATAGRAM_BYTES - _HEAD_RESERVE
_BATCH_BUDGET = wire.MAX_BATCH_BYTES - _HEAD_RESERVE
_RECORD_BUDGET = _DATAGRAM_BUDGET
_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_AGENT_RETRY_S = 10.0  # after the agent was found missing, try it again this often


@dataclass
class Config:
    mode: str = "auto"  # auto | agent | server | off
    agent_addr: tuple[str, int] = wire.LOCAL_HOOK_ADDR
    server: str | None = None
    token: str | None = None
    queue_size: int = 10_000
    interval: float = 0.5
    http_timeout: float = 2.0
    retries: int = 2  # extra attempts after the first, for 5xx / 429 / connection errors
    backoff: tuple[float, ...] = (0.25, 1.0)
    exit_timeout: float = 2.0
    beat_s: float = 1.0  # how often the rank says where it is (0: never)
    problems: list[str] = field(default_factory=list)  # configuration mistakes, warned about once at start

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Config:
        env = dict(os.environ) if env is None else env
        cfg = cls()
        cfg.mode = env.get("CLUSTERDX_HOOK_TRANSPORT", "auto").strip().lower() or "auto"
        if "CLUSTERDX_AGENT_ADDR" in env:
            cfg.agent_addr = cfg._parse_addr(env["CLUSTERDX_AGENT_ADDR"])
        cfg.server = env.get("CLUSTERDX_SERVER", "").strip().rstrip("/") or None
        cfg.token = env.get("CLUSTERDX_TOKEN", "").strip() or cfg._read_token(env.get("CLUSTERDX_TOKEN_FILE"))
        beat = env.get("CLUSTERDX_HOOK_BEAT_S", "").strip()
        if beat:
            try:
                cfg.beat_s = max(0.0, float(beat))
            except ValueError:
                cfg.problems.append(f"CLUSTERDX_HOOK_BEAT_S={beat!r} is not a number of seconds; using {cfg.beat_s}")
        for name, value in overrides.items():
            if value is not None:
                setattr(cfg, name, value)
        if cfg.mode not in ("auto", "agent", "server", "off"):
            cfg.problems.append(f"CLUSTERDX_HOOK_TRANSPORT={cfg.mode!r} is not auto, agent, server or off; using auto")
            cfg.mode = "auto"
        if cfg.mode == "server" and not cfg.server:
            cfg.problems.append("transport 'server' needs CLUSTERDX_SERVER; records will be dropped")
        if cfg.server and not cfg.token:
            cfg.problems.append("CLUSTERDX_SERVER is set but neither CLUSTERDX_TOKEN nor CLUSTERDX_TOKEN_FILE is")
        return cfg

    def _parse_addr(self, text: str) -> tuple[str, int]:
        host, _, port = text.strip().rpartition(":")
        try:
            return host.strip("[]") or "127.0.0.1", int(port)
        except ValueError:
            self.problems.append(f"CLUSTERDX_AGENT_ADDR={text!r} is not host:port; using {wire.LOCAL_HOOK_ADDR}")
            return wire.LOCAL_HOOK_ADDR

    def _read_token(self, path: str | None) -> str | None:
        if not path:
            return None
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip() or None
        except OSError as exc:
            self.problems.append(f"CLUSTERDX_TOKEN_FILE {path!r} cannot be read: {exc.strerror}")
            return None


class _Rejected(Exception):
    """The server refused the batch for good (4xx other than 429, or a redirect)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect: urllib would repeat the request with our ``Authorization`` header to wherever
    ``Location`` points (another host included). The 3xx becomes an HTTPError, refused in :meth:`Shipper._post`."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# Proxies from the environment as urlopen() has them; redirects never followed.
_opener = urllib.request.build_opener(_NoRedirect)


class Shipper:
    """Bounded queue + background thread. ``put`` is the only call on the training thread's hot path."""

    def __init__(self, host: str, config: Config) -> None:
        self.host, self.config = host, config
        self.pid = os.getpid()
        self.agent_id = ident(f"hook-{host}-{self.pid}-{int(time.time())}")
        self.seq = 0
        self._datagram_head = _dumps({"v": 1, "host": host, "pid": self.pid})[:-1].encode()
        self.dropped: dict[str, int] = {}
        # Set on this thread when a run metadata record ("runs") is dropped, read and cleared by the Monitor on the
        # training thread: the metadata is sent when it changes and every few minutes, so one lost at the start
        # (the rank up before its agent) left the server without the rank's host and settings for minutes.
        self.meta_lost = False
        self.sent = {"datagrams": 0, "batches": 0, "records": 0}
        self._queue: deque[tuple[str, Any]] = deque()
        self._off = config.mode == "off"
        self._wake = threading.Event()
        self._closing = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._agent_down_until = 0.0
        self._warned: set[str] = set()
        # Called first thing in close(), at exit too: the Monitor hands over the steps it still holds.
        self.before_close: Callable[[], None] | None = None
        # Where the training thread is, as a wire RankBeat; sent every config.beat_s from this thread.
        self.beat: Callable[[], dict[str, Any] | None] | None = None
        self._beat_due = 0.0
        for problem in config.problems:
            self.warn_once(problem, problem)
        _LIVE.add(self)

    # -- training thread -------------------------------------------------------------------------------------------
    def put(self, kind: str, record: Any) -> None:
        """``record``: a wire dict, or an object whose ``as_record()`` makes one (rendered on the shipping thread)."""
        if self._off:
            return
        if len(self._queue) >= self.config.queue_size:
            self._lose("queue_full", [(kind, b"")])
            return
        self._queue.append((kind, record))
        if self._thread is None:
            self._start()

    def drop(self, reason: str, count: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.warn_once(reason, f"clusterdx hooks dropped {count} record(s): {reason.replace('_', ' ')} "
                               "(counted and reported; training is not affected)")

    def _lose(self, reason: str, items: Encoded) -> None:
        """Drop shipped-off ``items``, noting a lost run metadata record (it is sent again, :attr:`meta_lost`)."""
        self.drop(reason, len(items))
        if any(kind == "runs" for kind, _ in items):
            self.meta_lost = True

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def flush(self, timeout: float = 2.0) -> bool:
        """Ship what is queued now; True when the queue drained within ``timeout``."""
        if self._off or self._thread is None:
            return not self._queue
        deadline = time.monotonic() + timeout
        self._wake.set()
        while (self._queue or self._busy) and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.002)
            self._wake.set()
        return not self._queue and not self._busy

    def close(self, timeout: float | None = None) -> None:
        if os.getpid() != self.pid:
            return
        if self.before_close is not None:
            try:
                self.before_close()
            except Exception as exc:  # a dead CUDA context at exit must not raise
                self.warn_once("before_close", f"clusterdx hooks: pending steps lost at close: {exc!r}")
        if self._off:
            return
        timeout = self.config.exit_timeout if timeout is None else timeout
        thread = self._thread
        if thread is None:
            if not self._queue:
                return
            self._start()
            thread = self._thread
        self._closing = True  # no backoff sleeps and no retries from here on: exit must be quick
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
        if self._queue:
            self.drop("exit_timeout", len(self._queue))
            self._queue.clear()
        self._off = True
        if self._sock is not None:
            self._sock.close()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="clusterdx-hooks", daemon=True)
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        self._off = True
        self._queue = deque()
        self._thread = None
        self._sock = None  # the parent's socket; the child must not send on it

    # -- background thread -----------------------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def _queue_beat(self) -> None:
        """A beat every ``beat_s``, and a last one at close: a rank blocked in a collective still beats, a dead
        or frozen one goes silent, which is how the server tells which rank stopped a run."""
        now = time.monotonic()
        if self.beat is None or self.config.beat_s <= 0 or (now < self._beat_due and not self._closing):
            return
        self._beat_due = now + self.config.beat_s
        record = self.beat()
        if record is not None:
            self._queue.append(("beats", record))

    def _loop(self) -> None:
        while True:
            self._wake.wait(min(self.config.interval, self.config.beat_s or self.config.interval))
            self._wake.clear()
            closing = self._closing
            try:
                self._queue_beat()
                self._ship_queued()
            except Exception as exc:  # a bug here must cost records, never the training run
                self.warn_once("internal", f"clusterdx hooks: shipping failed: {exc!r}")
            if closing:
                return

    def _ship_queued(self) -> None:
        while self._queue:
            self._busy = True
            try:
                self._ship(self._encode(self._take(_PER_TAKE)))
            finally:
                self._busy = False

    def _take(self, limit: int) -> list[tuple[str, Any]]:
        queue, out = self._queue, []
        for _ in range(limit):
            try:
                out.append(queue.popleft())
            except IndexError:
                break
        return out

    def _encode(self, items: list[tuple[str, Any]]) -> Encoded:
        """Each record encoded once, whichever way it then travels; sizes are exact from here on."""
        out: Encoded = []
        for n, (kind, record) in enumerate(items):
            try:
                if type(record) is not dict:  # a measured step, turned into its wire dict here, off the hot path
                    record = record.as_record()
                blob = _dumps(record).encode()
            except Exception as exc:  # NaN, a stray object, a bug upstream: it costs this record, nothing more
                self.drop("unencodable", 1)
                self.warn_once("unencodable_detail", f"clusterdx hooks: a record could not be encoded: {exc!r}")
                continue
            if len(blob) > _RECORD_BUDGET:
                self.drop("too_large", 1)
                continue
            out.append((kind, blob))
            if n % 256 == 255:
                time.sleep(0)  # hand the GIL back to the training thread between slices of a backlog
        return out

    def _ship(self, items: Encoded) -> None:
        mode = self.config.mode
        if mode in ("auto", "agent") and time.monotonic() >= self._agent_down_until:
            items = self._to_agent(items)
            if not items:
                return
            if mode == "agent":
                self._lose("agent_unreachable", items)
                return
        if self.config.server and mode in ("auto", "server"):
            for batch in _pack(items, _BATCH_BUDGET, _PER_BATCH):
                self._to_server(batch)
        else:
            self._lose("agent_unreachable", items)

    # -- UDP to the agent ------------------------------------------------------------------------------------------
    def _to_agent(self, items: Encoded) -> Encoded:
        """Sends datagrams; returns what could not be delivered (for the server, or to drop)."""
        chunks = list(_pack(items, _DATAGRAM_BUDGET, _PER_DATAGRAM))
        for i, chunk in enumerate(chunks):
            if i:
                time.sleep(0.001)  # a backlog goes out as a burst; pace it so the agent's socket buffer keeps up
            if not self._send_datagram(chunk):
                self._agent_down_until = time.monotonic() + _AGENT_RETRY_S
                self.warn_once("agent_down", f"clusterdx hooks: no agent listens on {self.config.agent_addr}; "
                               + ("posting to the server" if self.config.server else "records are dropped"))
                return [item for rest in chunks[i:] for item in rest]
        self._agent_down_until = 0.0
        return []

    def _send_datagram(self, chunk: Encoded) -> bool:
        payload = _assemble(self._datagram_head, chunk, self.dropped)
        try:
            sock = self._socket()
            sock.send(payload)
        except BlockingIOError:  # our socket buffer is full: the agent is alive but behind; shed, don't stall
            self._lose("socket_full", chunk)
            return True
        except OSError:
            return False
        try:
            # Loopback delivers the ICMP error during send(); reading SO_ERROR collects it (and clears it).
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                return False
        except OSError:
            return False
        self.sent["datagrams"] += 1
        self.sent["records"] += len(chunk)
        return True

    def _socket(self) -> socket.socket:
        if self._sock is None:
            host, port = self.config.agent_addr
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)  # a full socket buffer is a drop, never a stall
            sock.connect((host, port))
            self._sock = sock
        return self._sock

    # -- HTTP to the server ----------------------------------------------------------------------------------------
    def _to_server(self, items: Encoded) -> None:
        self.seq += 1
        head = _dumps({"v": 1, "agent_id": self.agent_id, "seq": self.seq, "host": self.host,
                       "sent_at": time.time()})[:-1].encode()
        body = _assemble(head, items, self.dropped)
        attempts = 1 + self.config.retries
        for attempt in range(attempts):
            try:
                self._post(body)
            except _Rejected as exc:
                self.drop("server_rejected", len(items))
                self.warn_once("server_rejected_detail", f"clusterdx hooks: the server refused a batch: {exc}")
                return
            except (OSError, urllib.error.URLError) as exc:  # connection refused, timeout, 5xx, 429
                if self._closing or attempt + 1 == attempts:
                    self._lose("server_unreachable", items)
                    self.warn_once("server_unreachable_detail", f"clusterdx hooks: cannot post to "
                                   f"{self.config.server}: {exc}")
                    return
                time.sleep(self.config.backoff[min(attempt, len(self.config.backoff) - 1)])
            else:
                self.sent["batches"] += 1
                self.sent["records"] += len(items)
                return

    def _post(self, body: bytes) -> None:
        headers = {"Content-Type": "application/json", "User-Agent": "clusterdx-hooks"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        if len(body) > 32 * 1024:
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        request = urllib.request.Request(f"{self.config.server}/api/v1/ingest", data=body, headers=headers)
        try:
            with _opener.open(request, timeout=self.config.http_timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:  # a wrong CLUSTERDX_SERVER (http -> https, a moved host): retrying cannot help
                raise _Rejected(f"HTTP {exc.code} redirect to {exc.headers.get('Location', '?')}: set CLUSTERDX_SERVER "
                                "to the final address (the token is never sent across a redirect)") from None
            if 400 <= exc.code < 500 and exc.code != 429:
                raise _Rejected(f"HTTP {exc.code} {_reason(exc)}") from None
            raise


def _reason(exc: urllib.error.HTTPError) -> str:
    try:
        answer = json.loads(exc.read(4096))
        return f"{answer.get('error', '')}: {answer.get('detail', '')}"
    except (ValueError, OSError, AttributeError):
        return str(exc.reason)


def _pack(items: Encoded, budget: int, per_kind: dict[str, int]) -> Iterator[Encoded]:
    """Consecutive runs of ``items`` whose encoded size fits ``budget`` and whose lists fit the wire's bounds."""
    chunk: Encoded = []
    size, counts = 0, dict.fromkeys(KINDS, 0)
    for kind, blob in items:
        if chunk and (size + len(blob) + 1 > budget or counts[kind] >= per_kind[kind]):
            yield chunk
            chunk, size, counts = [], 0, dict.fromkeys(KINDS, 0)
        chunk.append((kind, blob))
        size += len(blob) + 1
        counts[kind] += 1
    if chunk:
        yield chunk


def _assemble(head: bytes, items: Encoded, dropped: dict[str, int]) -> bytes:
    """``head`` is an encoded object without its closing brace; the record lists and drop counts are appended."""
    lists: dict[str, list[bytes]] = {kind: [] for kind in KINDS}
    for kind, blob in items:
        lists[kind].append(blob)
    body = bytearray(head)
    for kind, blobs in lists.items():
        if blobs:
            body += b',"' + kind.encode() + b'":[' + b",".join(blobs) + b"]"
    if dropped:
        body += b',"dropped":' + _dumps(dict(dropped)).encode()
    body += b"}"
    return bytes(body)


# ---------------------------------------------------------------------------------------------------------------
# Process-wide: fork and exit handling for every live shipper.

_LIVE: weakref.WeakSet[Shipper] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for shipper in list(_LIVE):
        shipper._after_fork_in_child()


def _at_exit() -> None:
    for shipper in list(_LIVE):
        with contextlib.suppress(Exception):  # interpreter shutdown: never turn a clean exit into a traceback
            shipper.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
