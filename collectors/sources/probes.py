"""Pairwise probes between agents (pingmesh-style): TCP round-trip time, loss, and now and then bandwidth.

Every agent runs the responder (:mod:`collectors.sources.probe_responder`) and probes its peers. A round, run in
a worker thread so the agent's loop never waits on the network:

1. picks the peers: all of them in a small cluster, else the next ``max_peers_per_round`` of the sorted list,
   starting at an offset derived from this host's name (so the nodes of a large cluster do not all probe the
   same peers at the same time);
2. sends each peer ``pings_per_peer`` small numbered messages over a kept-open connection and times each echo in
   user space; a message without its echo within ``timeout_s``, or a connection that cannot be made, is lost;
3. every ``bulk_period_s``, sends one peer (in turn) ``bulk_bytes`` and divides by the time to the answer. A link
   limited in bandwidth shows no extra idle round-trip time at all; only a bulk transfer reveals it.

``collect()`` reports the latest finished round once, one wire ``Probe`` per peer. The traffic is bounded: per
round at most ``max_peers_per_round × pings_per_peer × ping_bytes`` both ways, plus ``bulk_bytes`` once per
``bulk_period_s``; the time is bounded by ``max_round_s`` (peers not reached in time wait for the next round).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import socket
import ssl
import statistics
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from collectors.agent.source import Collected
from collectors.sources.probe_responder import BULK, DEFAULT_PORT, ECHO, LENGTH, Responder

MAX_PENDING_RECORDS = 4096

log = logging.getLogger(__name__)

_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]")
_BULK_CHUNK = bytes(65536)


@dataclass(frozen=True, slots=True)
class Peer:
    label: str  # what the Probe record names: the peer's host name
    host: str
    port: int


def parse_peer(text: str, default_port: int = DEFAULT_PORT) -> Peer:
    """ "node-1", "node-1:8651", "10.0.0.5:8651", "[fd00::5]:8651", or "label=host:port"."""
    text = text.strip()
    label, _, address = text.rpartition("=")
    host, port = address, default_port
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else default_port
    elif address.count(":") == 1:
        host, _, port_text = address.partition(":")
        port = int(port_text)
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad peer {text!r}: expected host[:port] or label=host:port")
    clean = _LABEL_BAD.sub("-", label or host).lstrip("-.") or "peer"
    return Peer(clean[:253], host, port)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@dataclass
class _Result:
    sent: int = 0
    lost: int = 0
    rtts_ms: list[float] = field(default_factory=list)
    bw_gbps: float | None = None

    def record(self, peer: Peer, ts: float) -> dict[str, Any]:
        out: dict[str, Any] = {"ts": ts, "peer": peer.label, "sent": self.sent, "lost": self.lost}
        if self.rtts_ms:
            out["rtt_ms"] = round(statistics.median(self.rtts_ms), 4)
            out["rtt_p99_ms"] = round(percentile(self.rtts_ms, 0.99), 4)
        if self.bw_gbps is not None:
            out["bw_gbps"] = round(self.bw_gbps, 4)
        return out


class _Prober:
    """One round at a time, over kept-open echo connections. Runs only in the worker thread."""

    def __init__(self, source: ProbeSource) -> None:
        self.cfg = source
        self.conns: dict[Peer, socket.socket] = {}
        self.seq = 0
        self.offset: int | None = None
        self.bulk_turn = 0
        self.last_bulk: float | None = None

    def round(self, peers: list[Peer]) -> list[dict[str, Any]]:
        chosen = self._choose(peers)
        deadline = time.monotonic() + self.cfg.max_round_s
        results: dict[Peer, _Result] = {}
        for peer in chosen:
            if time.monotonic() >= deadline:
                break
            results[peer] = self._ping(peer, deadline)
        self._advance(len(peers), len(results))
        for peer in [p for p in self.conns if p not in results]:
            self._close(peer)  # a rotating sample: connections to peers not probed this round are let go
        bulk_peer = self._bulk_due(peers) if time.monotonic() < deadline else None
        pinged = results.get(bulk_peer) if bulk_peer is not None else None
        if pinged is not None and pinged.sent and not pinged.rtts_ms:
            # Unreachable this round: a transfer would only wait out its timeout, and hold back this round's
            # record of the loss (what tells the server the peer is down) by that long.
            bulk_peer = None
        if bulk_peer is not None:
            results.setdefault(bulk_peer, _Result()).bw_gbps = self._bulk(bulk_peer)
        now = time.time()
        return [result.record(peer, now) for peer, result in results.items()]

    def close(self) -> None:
        for peer in list(self.conns):
            self._close(peer)

    # -- choosing -------------------------------------------------------------------------------------------------

    def _choose(self, peers: list[Peer]) -> list[Peer]:
        limit = self.cfg.max_peers_per_round
        if len(peers) <= limit:
            return peers
        if self.offset is None:
            digest = hashlib.sha256(self.cfg.self_name.encode()).digest()
            self.offset = int.from_bytes(digest[:4], "big") % len(peers)
        start = self.offset % len(peers)
        return [peers[(start + i) % len(peers)] for i in range(limit)]

    def _advance(self, total: int, probed: int) -> None:
        if self.offset is not None and total:
            self.offset = (self.offset + probed) % total

    def _bulk_due(self, peers: list[Peer]) -> Peer | None:
        if not peers or self.cfg.bulk_bytes <= 0:
            return None
        now = time.monotonic()
        if self.last_bulk is not None and now - self.last_bulk < self.cfg.bulk_period_s:
            return None
        self.last_bulk = now
        peer = peers[self.bulk_turn % len(peers)]
        self.bulk_turn += 1
        return peer

    # -- measuring ------------------------------------------------------------------------------------------------

    def _ping(self, peer: Peer, deadline: float) -> _Result:
        result = _Result(sent=self.cfg.pings_per_peer)
        failures = 0
        for _ in range(self.cfg.pings_per_peer):
            sock = self.conns.get(peer) or self._connect(peer)
            rtt = self._echo(peer, sock) if sock is not None and time.monotonic() < deadline else None
            if rtt is not None:
                result.rtts_ms.append(rtt * 1000.0)
                failures = 0
                continue
            failures += 1
            if sock is None or failures >= 2:
                break  # unreachable, or timing out again: the rest would be lost too, and cost a timeout each
        result.lost = result.sent - len(result.rtts_ms)
        return result

    def _echo(self, peer: Peer, sock: socket.socket) -> float | None:
        """One numbered message and its echo; None when lost. A lost echo closes the connection, so a late
        echo can never be taken for the answer to a later message."""
        self.seq += 1
        message = self.seq.to_bytes(8, "big") + bytes(max(0, self.cfg.ping_bytes - 8))
        try:
            started = time.perf_counter()
            sock.sendall(message)
            echoed = _recv_exactly(sock, len(message))
            elapsed = time.perf_counter() - started
        except OSError:
            echoed, elapsed = b"", 0.0
        if echoed != message:
            self._close(peer)
            return None
        return elapsed

    def _connect(self, peer: Peer) -> socket.socket | None:
        try:
            sock = socket.create_connection((peer.host, peer.port), timeout=self.cfg.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(ECHO)
        except OSError as exc:
            log.debug("probes: cannot connect to %s (%s:%d): %s", peer.label, peer.host, peer.port, exc)
            return None
        self.conns[peer] = sock
        return sock

    def _close(self, peer: Peer) -> None:
        sock = self.conns.pop(peer, None)
        if sock is not None:
            sock.close()

    def _bulk(self, peer: Peer) -> float | None:
        """Achievable bandwidth to one peer in Gb/s, over a fresh connection; None when the transfer failed."""
        total = self.cfg.bulk_bytes
        try:
            # Connecting takes one round trip on a working link: the pings' timeout bounds it, so a peer that went
            # away since its pings costs this round timeout_s, not bulk_timeout_s, before the round reports.
            with socket.create_connection((peer.host, peer.port), timeout=self.cfg.timeout_s) as sock:
                sock.settimeout(self.cfg.bulk_timeout_s)
                sock.sendall(BULK + LENGTH.pack(total))
                started = time.perf_counter()
                view = memoryview(_BULK_CHUNK)
                left = total
                while left > 0:
                    left -= sock.send(view[: min(left, len(view))])
                    if time.perf_counter() - started > self.cfg.bulk_timeout_s:
                        raise TimeoutError("bulk transfer took longer than bulk_timeout_s")
                answer = _recv_exactly(sock, LENGTH.size)
                elapsed = time.perf_counter() - started
        except OSError as exc:
            log.debug("probes: bulk transfer to %s failed: %s", peer.label, exc)
            return None
        if answer != LENGTH.pack(total) or elapsed <= 0:
            return None
        return total * 8 / elapsed / 1e9


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


class ProbeSource:
    """Pairwise TCP probes to the peers' agents, as wire ``Probe`` records; and the responder for theirs.

    Options (the ``[sources.probes]`` table of agent.toml):

    * ``peers`` (``[]``): ``["node-1:8651", "node-2", "gpu7=10.0.0.7:8651"]``; the label before ``=`` (else the
      host) names the peer in the records.
    * ``peers_file`` (``None``): one peer per line (``#`` comments), re-read when it changes; added to ``peers``.
    * ``port`` (``8651``): the responder's port, and the default port of peers given without one.
    * ``listen`` (``True``), ``listen_host`` (``"0.0.0.0"``): run the responder, on this address.
    * ``self_name`` (this host's name): peers with this label are skipped, so one shared list serves all nodes.
    * ``round_s`` (``2.0``): a round starts this often (or when the previous one ends, if later).
    * ``pings_per_peer`` (``4``), ``ping_bytes`` (``64``), ``timeout_s`` (``1.0``): the echo probes.
    * ``max_peers_per_round`` (``16``): above this many peers, each round probes a rotating sample.
    * ``max_round_s`` (``5.0``): a round stops starting new probes after this long.
    * ``bulk_bytes`` (``4 MiB``; 0 = never), ``bulk_period_s`` (``30``), ``bulk_timeout_s`` (``5.0``): bandwidth
      probes, one peer at a time, in turn.
    * ``max_conns`` (``256``), ``max_bulk_bytes`` (``64 MiB``): what the responder accepts.
    * ``plan`` (``"static"``): ``"server"`` adds the peers the server plans for this node (same-leaf neighbours plus
      a rotating cross-leaf sample; ``GET /api/v1/probes/peers``), asked again every ``plan_refresh_s`` (``0`` = the
      server's ``round_s``). ``server``, ``token_file``, ``ca_file``, ``http_timeout_s`` and ``self_name`` come
      from the agent's own settings (the config fills them in); a failed ask keeps the last plan, logged once.
    """

    name = "probes"

    def __init__(self, *, peers: list[str] | None = None, peers_file: str | None = None, port: int = DEFAULT_PORT,
                 listen: bool = True, listen_host: str = "0.0.0.0", self_name: str | None = None,
                 round_s: float = 2.0, pings_per_peer: int = 4, ping_bytes: int = 64, timeout_s: float = 1.0,
                 max_peers_per_round: int = 16, max_round_s: float = 5.0, bulk_bytes: int = 4 << 20,
                 bulk_period_s: float = 30.0, bulk_timeout_s: float = 5.0, max_conns: int = 256,
                 max_bulk_bytes: int = 64 << 20, plan: str = "static", server: str = "", token_file: str = "",
                 ca_file: str = "", plan_refresh_s: float = 0.0, http_timeout_s: float = 10.0) -> None:
        if plan not in ("static", "server"):
            raise ValueError(f"plan must be 'static' or 'server', got {plan!r}")
        if plan == "server" and not (server and token_file):
            raise ValueError("plan = 'server' needs the agent's server and token_file")
        self.port = port
        self.static_peers = [parse_peer(p, port) for p in peers or []]  # a typo fails at startup, by name
        self.peers_file = peers_file
        self.listen = listen
        self.listen_host = listen_host
        self.self_name = self_name or socket.gethostname()
        self.round_s = round_s
        self.pings_per_peer = max(1, pings_per_peer)
        self.ping_bytes = max(8, ping_bytes)
        self.timeout_s = timeout_s
        self.max_peers_per_round = max(1, max_peers_per_round)
        self.max_round_s = max_round_s
        self.bulk_bytes = bulk_bytes
        self.bulk_period_s = bulk_period_s
        self.bulk_timeout_s = bulk_timeout_s
        self.responder = Responder(listen_host, port, max_conns=max_conns, max_bulk_bytes=max_bulk_bytes)
        self._file_peers: list[Peer] = []
        self._file_stamp: tuple[float, int] | None = None
        self._file_error: str | None = None  # the last reason the peers file could not be read (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: list[dict[str, Any]] = []
        self._jitter = random.Random()
        self._round = self._reported = 0
        self._notes: list[str] = []
        self.plan = plan
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.plan_refresh_s = plan_refresh_s
        self.http_timeout_s = http_timeout_s
        self._ssl = ssl.create_default_context(cafile=ca_file or None) if self.server.startswith("https") else None
        self._server_peers: list[Peer] = []
        self._plan_due = 0.0  # monotonic time of the next ask
        self._plan_error: str | None = None  # the last reason the ask failed (logged once per change)

    def start(self) -> str | None:
        listening = False
        if self.listen:
            try:
                self.responder.start()
                listening = True
            except OSError as exc:
                self._notes.append(f"probe responder off: cannot listen on {self.listen_host}:{self.port}: "
                                   f"{exc.strerror}; peers cannot probe this node")
        if not (self.static_peers or self.peers_file or self.plan == "server"):
            return None if listening else "no peers configured and no responder"
        self._thread = threading.Thread(target=self._run, name="clusterdx-prober", daemon=True)
        self._thread.start()
        return None

    def collect(self, now: float, out: Collected) -> None:
        for note in self._notes:
            out.events.append({"ts": now, "kind": "agent", "severity": "warning", "message": note})
        self._notes.clear()
        with self._lock:
            if self._round == self._reported:
                return
            self._reported = self._round
            # Every round finished since the last collect, not only the newest: with rounds as frequent as the
            # samples, two could end between collects and one (its bulk transfer with it) was lost for good.
            out.probes.extend(self._latest)
            self._latest = []

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.max_round_s + self.bulk_timeout_s + 2)
        self.responder.stop()

    @property
    def listening_port(self) -> int:
        """The port the responder is bound to (0 when it is not running)."""
        return self.responder.port

    def peers(self) -> list[Peer]:
        """The current peer list: static and from the file, without this host, sorted, without duplicates."""
        if self.peers_file:
            self._reload_file()
        if self.plan == "server" and time.monotonic() >= self._plan_due:
            self._refresh_plan()
        short = self.self_name.split(".")[0]
        unique = {p for p in self.static_peers + self._file_peers + self._server_peers if p.label not in (self.self_name, short)}
        return sorted(unique, key=lambda p: (p.label, p.host, p.port))

    def _reload_file(self) -> None:
        assert self.peers_file
        try:
            st = os.stat(self.peers_file)
            if self._file_stamp == (st.st_mtime, st.st_size):
                return
            with open(self.peers_file, encoding="utf-8") as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
        except OSError as exc:
            # Once per change of state, not every round: the shipped config names a peers file that a node without
            # the Slurm prolog or the DaemonSet's init step may never get (it probed nothing; the log filled up).
            if str(exc) != self._file_error:
                log.warning("probes: cannot read peers file %s: %s (probing only the static peers)", self.peers_file, exc)
            self._file_error = str(exc)
            self._file_stamp = None
            return
        self._file_error = None
        parsed = []
        for line in filter(None, lines):
            try:
                parsed.append(parse_peer(line, self.port))
            except ValueError as exc:
                log.warning("probes: %s: %s", self.peers_file, exc)
        self._file_peers, self._file_stamp = parsed, (st.st_mtime, st.st_size)

    def _refresh_plan(self) -> None:
        """Ask the server for this node's peers. Runs in the worker thread (peers() is called there), so a slow
        server delays a round, never the agent's loop; one small GET every few minutes keeps the CPU budget."""
        query = urllib.parse.urlencode({"host": self.self_name, "port": self.port})
        try:
            with open(self.token_file, encoding="utf-8") as f:
                token = f.read().strip()  # re-read each time, as the delivery does: a rotated token is picked up
            request = urllib.request.Request(f"{self.server}/api/v1/probes/peers?{query}",
                                             headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
            with urllib.request.urlopen(request, timeout=self.http_timeout_s, context=self._ssl) as answer:
                body = json.loads(answer.read(1 << 20))
            peers = [Peer(_LABEL_BAD.sub("-", str(p["host"])).lstrip("-.")[:253] or "peer", str(p["address"]),
                          int(p["port"])) for p in body["peers"]]
            round_s = float(body.get("round_s") or 60.0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            detail = exc.read(300).decode(errors="replace") if isinstance(exc, urllib.error.HTTPError) else ""
            reason = f"{exc} {detail}".strip()
            if reason != self._plan_error:
                log.warning("probes: cannot get the server's probe plan: %s (keeping the last plan, %d peers)",
                            reason, len(self._server_peers))
            self._plan_error = reason
            self._plan_due = time.monotonic() + min(60.0, self.plan_refresh_s or 60.0)
            return
        if self._plan_error is not None:
            log.info("probes: server probe plan reachable again (%d peers)", len(peers))
        self._plan_error = None
        self._server_peers = peers
        self._plan_due = time.monotonic() + max(5.0, self.plan_refresh_s or round_s)

    def _run(self) -> None:
        prober = _Prober(self)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    records = prober.round(self.peers())
                except Exception:  # a bug in one round must not end probing for the life of the agent
                    log.exception("probes: round failed")
                    records = []
                with self._lock:
                    # Bounded: an agent whose sender is stuck keeps the newest rounds (records are per peer).
                    self._latest = (self._latest + records)[-MAX_PENDING_RECORDS:]
                    self._round += 1
                # Each round lasts round_s ± 5 % at random: agents started together (a whole cluster rebooted, a
                # DaemonSet rolled out) drift apart within minutes instead of probing in step for good, when their
                # bulk transfers land on the same nodes at the same moment and each measures a share of a link.
                period = self.round_s * self._jitter.uniform(0.95, 1.05)
                self._stop.wait(max(0.0, period - (time.monotonic() - started)))
        finally:
            prober.close()
