"""The probe protocol and its responder: a small TCP echo and bulk sink that every agent runs for its peers.

A connection starts with a one-byte mode, and may carry several requests one after the other:

* ``E`` then any bytes: every byte is echoed back as it arrives, until the client closes. The prober sends
  small numbered messages and times each round trip in user space, so time spent in the peer's network stack
  and scheduler counts, as it does for NCCL (kernel timestamps, as plain ``ping`` uses, would hide it).
* ``B`` then an 8-byte big-endian length N (at most ``max_bulk_bytes``), then N bytes: the responder discards
  them and answers with the same 8-byte N once it has them all. The prober divides N by the time to the answer.

The responder is one thread around a selector, with non-blocking sockets: it cannot be stalled by a slow or
malicious client, it holds at most ``max_conns`` connections, and it closes connections idle for
``idle_timeout_s`` or that do not follow the protocol.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_PORT = 8651
ECHO = b"E"
BULK = b"B"
LENGTH = struct.Struct("!Q")
_RECV = 262144
_MAX_PENDING_ECHO = 65536  # a client that sends and never reads is cut off, not buffered without end


@dataclass
class _Conn:
    sock: socket.socket
    last: float
    mode: bytes = b""
    header: bytes = b""
    remaining: int = 0
    total: int = 0
    out: bytearray = field(default_factory=bytearray)
    writing: bool = False  # registered for EVENT_WRITE


class Responder:
    """The TCP echo / bulk-sink server. ``start()`` binds (raising ``OSError`` when it cannot) and starts the
    thread; ``port`` is the bound port (useful with ``port=0``); ``stop()`` closes everything."""

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_PORT, max_conns: int = 256,
                 max_bulk_bytes: int = 64 << 20, idle_timeout_s: float = 120.0) -> None:
        self.host = host
        self.requested_port = port
        self.max_conns = max_conns
        self.max_bulk_bytes = max_bulk_bytes
        self.idle_timeout_s = idle_timeout_s
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.requested_port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()  # lets stop() interrupt the select at once
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="clusterdx-probe-responder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._listener is None:
            return  # never started
        self._stop.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(5)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._listener = None
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- the loop -------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_sweep = time.monotonic() + 1.0
        while not self._stop.is_set():
            for key, mask in self._selector.select(timeout=1.0):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.data is not None:
                    self._service(key.data, mask)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + 1.0
                for conn in [c for c in self._conns.values() if now - c.last > self.idle_timeout_s]:
                    self._drop(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if len(self._conns) >= self.max_conns:
            sock.close()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, time.monotonic())
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not self._receive(conn):
                self._drop(conn)
                return
            if conn.out:
                del conn.out[: conn.sock.send(conn.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        if bool(conn.out) != conn.writing:  # only a client slow to read makes us wait to write
            conn.writing = bool(conn.out)
            self._selector.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE * conn.writing), conn)

    def _receive(self, conn: _Conn) -> bool:
        data = conn.sock.recv(_RECV)
        if not data:
            return False
        conn.last = time.monotonic()
        return self._consume(conn, data)

    def _consume(self, conn: _Conn, data: bytes) -> bool:
        """Advance the connection's protocol state; False when the client broke the protocol."""
        while data:
            if not conn.mode:
                conn.mode, data = data[:1], data[1:]
                if conn.mode not in (ECHO, BULK):
                    return False
            elif conn.mode == ECHO:
                conn.out += data
                return len(conn.out) <= _MAX_PENDING_ECHO
            elif len(conn.header) < LENGTH.size:
                need = LENGTH.size - len(conn.header)
                conn.header, data = conn.header + data[:need], data[need:]
                if len(conn.header) == LENGTH.size:
                    conn.remaining = conn.total = LENGTH.unpack(conn.header)[0]
                    if conn.total > self.max_bulk_bytes:
                        return False
                    data = self._bulk(conn, data)
            else:
                data = self._bulk(conn, data)
        return True

    def _bulk(self, conn: _Conn, data: bytes) -> bytes:
        take = min(conn.remaining, len(data))
        conn.remaining -= take
        if conn.remaining == 0:
            conn.out += LENGTH.pack(conn.total)
            conn.mode, conn.header = b"", b""  # ready for the next request on this connection
        return data[take:]

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            self._conns.pop(fd, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()
