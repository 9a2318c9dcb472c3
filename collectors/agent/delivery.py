"""Sending spooled batches to the server, oldest first, on a thread of its own.

The sampling loop never waits for the network: it puts each batch into the spool and wakes this thread. Outcomes
follow the ingest contract in :mod:`clusterdx.wire`: 2xx deletes the batch; 429, 5xx and network errors keep it
and retry with exponential backoff and jitter (honouring ``Retry-After``); 400, 413 and 415 mean this batch can
never be accepted, so it is dropped, counted (``server_rejected``) and its reason logged once per reason; 401 and
403 are a token problem, not a batch problem, so batches stay in the spool (bounded) while the token file is
re-read before each slow retry. 409 ``seq_reused`` says the content is fine but its number was already used for
other content (the spool's counter went back): the batch is renumbered and sent again, never deleted.

The server may ask for fewer posts: a 200 or 429 answer carrying ``send_interval_s`` is the minimum time it wants
between one agent's posts (a large cluster's server raises it). The sender only remembers the latest such advert
(:attr:`Sender.advised_interval_s`); the sampling loop reads it and seals several intervals into one batch.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import random
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from collectors.agent.spool import Spool, Spooled

log = logging.getLogger("clusterdx.agent.delivery")

AUTH_RETRY_S = 30.0
# The most a server's advert may stretch the send interval: a broken or hostile server must not make a node's data
# days late (the spool still keeps everything; this only bounds how much one post may hold back).
MAX_ADVISED_INTERVAL_S = 300.0


@dataclass
class Stats:
    sent: int = 0
    duplicates: int = 0
    rejected: int = 0
    renumbered: int = 0
    failures: int = 0
    last_error: str = ""
    last_success: float = 0.0
    by_status: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    kind: str  # "ok", "retry", "reject", "auth", "renumber"
    detail: str = ""
    status: int = 0
    retry_after: float | None = None
    send_interval_s: float | None = None  # the server's advert in this answer, if any (see the module docstring)


class Poster:
    """One persistent HTTP(S) connection to the server's ingest endpoint (a TLS handshake per batch is costly)."""

    def __init__(self, server: str, token: Callable[[], str], *, timeout: float, ca_file: str = "") -> None:
        url = urlsplit(server.rstrip("/") + "/api/v1/ingest")
        self.path = url.path
        self.host = url.hostname or "localhost"
        self.port = url.port
        self.https = url.scheme == "https"
        self.timeout = timeout
        self._read_token = token
        self._token: str | None = None
        self._ssl = ssl.create_default_context(cafile=ca_file or None) if self.https else None
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.https:
                self._conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                                         context=self._ssl)
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def post(self, body: bytes) -> Outcome:
        # A kept-alive connection the server has since closed fails on first use; one fresh retry tells that
        # apart from a server that is really down. The server is idempotent on (agent_id, seq).
        for attempt in (0, 1):
            try:
                return self._post_once(body)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt or not isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                                   ConnectionResetError)):
                    return Outcome("retry", f"{type(exc).__name__}: {exc}")
        return Outcome("retry", "unreachable")

    def _post_once(self, body: bytes) -> Outcome:
        if self._token is None:
            try:
                self._token = self._read_token()
            except ValueError as exc:  # ConfigError: the file went missing or empty
                return Outcome("auth", str(exc), 0)
        conn = self._connection()
        conn.request("POST", self.path, body=body, headers={
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        })
        resp = conn.getresponse()
        payload = resp.read(64 * 1024)
        if resp.will_close:
            self.close()
        outcome = classify(resp.status, payload, resp.getheader("Retry-After"))
        if outcome.kind == "auth":
            self._token = None  # the admin may have replaced the file: read it again before the next try
        return outcome

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def classify(status: int, payload: bytes, retry_after: str | None) -> Outcome:
    data = _json(payload)
    detail = _detail(payload, data)
    # Only our server's answers that mean "this is how often to post": a proxy's 5xx says nothing about it.
    advert = advised_interval(data) if 200 <= status < 300 or status == 429 else None
    if 200 <= status < 300:
        return Outcome("ok", detail, status, send_interval_s=advert)
    if status in (401, 403):
        return Outcome("auth", detail, status)
    if status in (408, 429) or status >= 500:
        return Outcome("retry", detail, status, _seconds(retry_after), advert)
    if status == 409 and detail.startswith("seq_reused:"):  # only our server's answer; another 409 is a refusal
        return Outcome("renumber", detail, status)
    return Outcome("reject", detail, status)


def _predates_v2(outcome: Outcome) -> bool:
    """A server's refusal of wire version 2 itself (a release before it), not of a batch's content."""
    return outcome.status == 400 and outcome.detail.startswith("invalid_batch: v: unsupported wire version 2;")


def advised_interval(answer: object) -> float | None:
    """The ``send_interval_s`` a server answer asks for, capped at :data:`MAX_ADVISED_INTERVAL_S`; None when the
    answer has none or a value that is not a positive number (then the agent keeps what it had)."""
    value = answer.get("send_interval_s") if isinstance(answer, dict) else None
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        return None
    return min(float(value), MAX_ADVISED_INTERVAL_S)


def _json(payload: bytes) -> object:
    try:
        return json.loads(payload)
    except ValueError:
        return None


def _detail(payload: bytes, data: object) -> str:
    if data is None:
        return payload[:300].decode(errors="replace").strip()
    if isinstance(data, dict):
        if "error" in data:
            return f"{data.get('error')}: {data.get('detail', '')}".strip(": ")[:500]
        return str(data.get("status", ""))
    return ""


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date; the backoff is good enough


class Backoff:
    """Exponential, capped, with "equal jitter" so that a fleet of agents does not retry in lockstep."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self.failures = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        step = min(self.maximum, self.initial * 2 ** min(self.failures, 30))
        self.failures += 1
        return step / 2 + self._rng.uniform(0, step / 2)

    def reset(self) -> None:
        self.failures = 0


class Sender:
    def __init__(self, spool: Spool, poster: Poster, backoff: Backoff) -> None:
        self.spool = spool
        self.poster = poster
        self.backoff = backoff
        self.stats = Stats()
        self.advised_interval_s: float | None = None  # the server's latest send_interval_s advert
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._logged: set[str] = set()
        self._renumbered: tuple[int, int] = (-1, 0)  # the seq renumbering last gave, and how often that batch was
        self._thread = threading.Thread(target=self._run, name="clusterdx-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, grace_s: float) -> None:
        """Let the thread finish what is spooled for up to ``grace_s``, then stop it."""
        deadline = time.monotonic() + grace_s
        while self.spool.depth and time.monotonic() < deadline and not self.backoff.failures:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(1.0, self.poster.timeout + 1))
        self.poster.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                delay = self._step()
            except Exception:  # a bug or a broken spool must not silently end delivery for good
                log.exception("delivery failed unexpectedly; retrying after a backoff")
                delay = self.backoff.next()
            if delay:
                self._stop.wait(delay)

    def _step(self) -> float:
        item = self.spool.oldest()
        if item is None:
            self._wake.wait()
            self._wake.clear()
            return 0.0
        return self.deliver(item)

    def deliver(self, item: Spooled) -> float:
        """Send one batch and act on the answer; returns how long to wait before the next attempt."""
        outcome = self.poster.post(item.body)
        self.stats.by_status[outcome.status] = self.stats.by_status.get(outcome.status, 0) + 1
        if outcome.send_interval_s is not None and outcome.send_interval_s != self.advised_interval_s:
            log.info("the server asks for at most one post every %gs (was %s)", outcome.send_interval_s,
                     f"{self.advised_interval_s:g}s" if self.advised_interval_s else "not asked")
            self.advised_interval_s = outcome.send_interval_s
        if outcome.kind == "ok":
            self.spool.delete(item.seq)
            self.stats.sent += 1
            self.stats.duplicates += outcome.detail == "duplicate"
            self.stats.last_success = time.time()
            if self.backoff.failures:
                log.info("server reachable again; replaying %d spooled batch(es)", self.spool.depth)
            self.backoff.reset()
            self._logged.discard("retry")
            return 0.0
        if outcome.kind == "renumber":
            return self._renumber(item, outcome)
        if outcome.kind == "reject" and _predates_v2(outcome) and getattr(self.spool, "wire_version", 1) == 2:
            n = self.spool.downgrade()
            log.warning("the server predates wire version 2 (%s): %d spooled batch(es) rewritten as version 1, and "
                        "version 1 sent from now on; set wire_version = 1 in agent.toml to say so", outcome.detail, n)
            return 0.0
        if outcome.kind == "reject":
            self.spool.discard(item.seq, "server_rejected")
            self.stats.rejected += 1
            # Once per kind of refusal: numbers vary between batches ("86400 s ahead", "gpus[3]"), the reason not.
            self._log_once(f"reject:{outcome.status}:{re.sub(r'[0-9.]+', '#', outcome.detail)}", logging.ERROR,
                           "server rejected batch %d with %d (%s); dropped, not retried",
                           item.seq, outcome.status, outcome.detail or "no reason given")
            return 0.0
        return self._failed(item, outcome)

    def _renumber(self, item: Spooled, outcome: Outcome) -> float:
        new = self.spool.renumber(item.seq)
        self.stats.renumbered += 1
        self._log_once("renumber", logging.WARNING, "the server holds batch %d with other content (%s): this spool's "
                       "sequence counter went back (an OS crash, a restored spool); sent again as batch %s, and so "
                       "will be any other batch it refuses so", item.seq, outcome.detail, new)
        # One renumbering jumps past the whole reused stretch; a server that refuses the same batch again and again
        # gets the backoff, not a tight loop.
        again = self._renumbered[1] + 1 if item.seq == self._renumbered[0] else 1
        self._renumbered = (new if new is not None else -1, again)
        return 0.0 if again <= 2 else self.backoff.next()

    def _failed(self, item: Spooled, outcome: Outcome) -> float:
        self.stats.failures += 1
        self.stats.last_error = f"{outcome.status or ''} {outcome.detail}".strip()
        if outcome.kind == "auth":
            self._log_once(f"auth:{outcome.status}", logging.ERROR,
                           "token refused (%s: %s); batches stay spooled, the token file is re-read every %gs",
                           outcome.status, outcome.detail, AUTH_RETRY_S)
            self.backoff.failures += 1
            return AUTH_RETRY_S
        delay = self.backoff.next()
        if outcome.retry_after is not None:
            delay = min(max(delay, outcome.retry_after), self.backoff.maximum)
        self._log_once("retry", logging.WARNING, "cannot deliver batch %d (%s); spooling, retrying with backoff",
                       item.seq, self.stats.last_error)
        return delay

    def _log_once(self, key: str, level: int, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)
