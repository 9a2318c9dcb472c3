"""``POST /api/v1/ingest``: the one door for agents and hooks.

Checks run cheapest first (method, headers, size, token) so a flood of bad requests costs little, and nothing is
written until the whole batch has validated: a refused batch changes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from zlib_ng import zlib_ng

from clusterdx import wire
from dashboard import metrics
from dashboard.ingest import blocks, commit
from dashboard.ingest.errors import ERRORS
from dashboard.ingest.writer import NODE_CREATED, Stored
from dashboard.telemetry import models as m
from dashboard.telemetry import tokens
from dashboard.telemetry.models import IngestToken

log = logging.getLogger(__name__)


def _limit() -> int:
    from django.conf import settings

    return int(settings.CLUSTERDX["INGEST_MAX_BODY_BYTES"])


def clock_skew(batch: dict[str, Any], now: float) -> str | None:
    """Why the batch's times cannot be trusted against the server's clock ``now``, or None.

    A node whose clock runs a day ahead would look heard-from in the future (``last_step_at`` only moves forward, so
    its run could not be reported hung for a day) and its rows would escape retention: refuse the batch and say why,
    the node's log shows it. Behind is bounded by the retention on ``sent_at`` only: a batch sent before the oldest
    row the server keeps is a clock set back (or a replay purged on arrival), while an old record in a fresh batch
    (a log read from its start) is harmless and simply ages out."""
    from django.conf import settings

    ahead = float(settings.CLUSTERDX["INGEST_MAX_FUTURE_S"])
    if _newest(batch) > now + ahead:  # only then name the first record ahead (a path string per record is dear)
        for path, ts in _timestamps(batch):
            if ts > now + ahead:
                return (f"{path}: {ts - now:.0f} s ahead of the server's clock (limit {ahead:g} s, "
                        "CLUSTERDX_INGEST_MAX_FUTURE_S); check the node's time sync (chrony, ntpd)")
    retention_h = float(settings.CLUSTERDX["RETENTION_HOURS"])
    if batch["sent_at"] < now - retention_h * 3600:
        return (f"sent_at: sent {(now - batch['sent_at']) / 3600:.0f} h ago, beyond the retention of {retention_h:g} h; "
                "check the node's time sync")
    return None


_TS = wire.Fields("ts")


def _newest(batch: dict[str, Any]) -> float:
    """The latest of ``sent_at`` and every record's ``ts``: the times :func:`clusterdx.wire.timestamps` yields (a
    validated batch's record lists are lists of dicts or of the records it kept, each with its ``ts``), without a path
    for each."""
    newest = batch["sent_at"] if batch.get("sent_at") is not None else 0.0
    for value in batch.values():
        if type(value) is list and value:
            first = value[0]
            if "ts" in (first if type(first) is dict else getattr(first, "__struct_fields__", ())):
                newest = max(newest, max(map(_TS.of(value), value)))
        elif type(value) is blocks.Block and len(value):
            newest = max(newest, float(value.column("ts").max()))
    return newest


def _timestamps(batch: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """:func:`clusterdx.wire.timestamps` of a batch whose record lists may be version 2 blocks."""
    plain = {k: [] if type(v) is blocks.Block else v for k, v in batch.items()}
    yield from wire.timestamps(wire.Batch, plain)
    for kind, value in batch.items():
        if type(value) is blocks.Block:
            for i, ts in enumerate(value.column("ts").tolist()):
                yield f"{kind}[{i}].ts", ts


def _read_body(request: HttpRequest, limit: int) -> bytes | None:
    """The raw body, or None when it is over ``limit`` (read no further than limit + 1 bytes)."""
    declared = request.META.get("CONTENT_LENGTH")
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    data = request.read(limit + 1)
    return None if len(data) > limit else data


def _gunzip(data: bytes, limit: int) -> bytes | None:
    """Decompress with a hard output bound: a 10 kB gzip bomb must not become 10 GB of memory. zlib-ng's inflate,
    zlib's API: a gzipped post in half the time (it was a sixth of the event loop's CPU at 2,048 nodes)."""
    inflater = zlib_ng.decompressobj(wbits=16 + zlib_ng.MAX_WBITS)
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise OverflowError
    if not inflater.eof:
        raise zlib_ng.error("truncated gzip stream")
    return out


Answer = tuple[int, dict[str, Any], dict[str, str]]  # status, JSON body, extra headers


def _refuse(code: str, detail: str) -> Answer:
    status = ERRORS[code][0]
    return status, {"error": code, "detail": detail}, ({"Retry-After": "5"} if status == 503 else {})



def check_request(method: str, headers: Mapping[str, str]) -> Answer | None:
    """What can be refused from the request line and headers alone (``headers`` with lower-case names)."""
    if method != "POST":
        status, body, _ = _refuse("method_not_allowed", f"{method} is not allowed; POST a batch")
        return status, body, {"Allow": "POST"}
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        return _refuse("unsupported_media_type", f"Content-Type {content_type or '(none)'!r} is not application/json")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        return _refuse("unsupported_media_type", f"Content-Encoding {encoding!r} is not supported (gzip or identity)")
    if not headers.get("authorization", "").startswith("Bearer "):
        return _refuse("missing_token", "send 'Authorization: Bearer <token>' (clusterdx token create CLUSTER)")
    return None


def begin(headers: Mapping[str, str], body: bytes | None, limit: int,
          in_loop: tuple[IngestToken, float] | None = None) -> Answer | Waiting:
    """The rest, once the headers passed: token, size, encoding, JSON, wire format, then the batch goes to the group
    writer (:mod:`.commit`), or is refused with 429 ``busy`` when its queue is full.

    ``body`` is None when it was over ``limit``. Nothing is written unless every check passed. ``in_loop``: for a
    call in the event loop, where no query may run, the token row from the token cache and the send interval, as
    :func:`ready_in_loop` found them (taken as they were then: the checks below may outlast the interval's refresh)."""
    token = in_loop[0] if in_loop is not None else tokens.lookup(headers["authorization"][len("Bearer "):].strip())
    if token is None:
        return _refuse("unknown_token", "the token is unknown or has been revoked")
    if body is None:
        return _refuse("too_large", f"body over {limit} bytes; send smaller batches")
    gzipped = headers.get("content-encoding", "identity").strip().lower() == "gzip"
    remote = in_loop is not None or not connection.in_atomic_block
    remote = remote and commit.writer().remote is not None
    checked: Checked | Answer | None = None
    if not remote:  # else the writer's process checks the body (check_body), and the answer waits for it anyway
        checked = check_body(Poster.of(token), body, gzipped, limit)
        if not isinstance(checked, Checked):
            return checked
    try:
        if in_loop is None:
            tokens.mark_used(token)
            _mark_looked[(token.id, token.prefix)] = time.monotonic()
        interval = send_interval(token.cluster_id) if in_loop is None else in_loop[1]
        if checked is None:
            future = commit.writer().submit_unchecked(Poster.of(token), body, gzipped, limit)
        else:
            future = commit.submit(token.cluster, checked.batch, checked.digest, in_loop=in_loop is not None)
    except commit.Busy:
        return _busy(interval)
    except DatabaseError as exc:
        return _unavailable(None if checked is None else checked.batch, exc)
    return Waiting(future, None if checked is None else checked.batch, interval)


@dataclass(frozen=True)
class Poster:
    """What the body's checks need of the token that posted it (picklable: the writer's process checks it too)."""

    cluster_id: int
    cluster_name: str
    scope: str
    hosts: str

    @classmethod
    def of(cls, token: IngestToken) -> Poster:
        return cls(token.cluster_id, token.cluster.name, token.scope, token.hosts)


@dataclass(frozen=True)
class Checked:
    batch: dict[str, Any]
    digest: str


def check_body(poster: Poster, body: bytes, gzipped: bool, limit: int) -> Checked | Answer:
    """Encoding, JSON, wire format, the token's cluster and scope, the clock: the valid batch, or the refusal."""
    if gzipped:
        try:
            body = _gunzip(body, limit)
        except OverflowError:
            return _refuse("too_large", f"decompressed body over {limit} bytes; send smaller batches")
        except zlib_ng.error as exc:
            return _refuse("bad_encoding", f"invalid gzip body: {exc}")
    try:
        # Decoded and validated in one pass (msgspec types generated from the wire); its wide records stay records.
        # Version 2's blocks (clusterdx.blocks) are checked a whole matrix at a time.
        batch = blocks.parse(body)
    except wire.MalformedJson as exc:
        return _refuse("malformed_json", f"invalid JSON: {str(exc)[:200]}")
    except wire.WireError as exc:
        return _refuse("invalid_batch", str(exc)[:500])
    if batch["cluster"] is not None and batch["cluster"] != poster.cluster_name:
        return _refuse("wrong_cluster", f"token is for cluster {poster.cluster_name!r}, batch names {batch['cluster']!r}")
    # Here, where token and batch meet, both doors (this view and the ASGI fast path) refuse alike.
    scope = tokens.scope_refusal(poster, batch)
    if scope is not None:
        return _refuse("token_scope", scope)
    skew = clock_skew(batch, time.time())
    if skew is not None:
        # A version 2 post's numbers are checked by the group writer (blocks.check_posts): one whose time is beyond
        # what the wire allows is refused as invalid, as version 1's would be, not as a clock ahead.
        invalid = blocks.check_posts([batch])[0]
        if invalid is not None:
            return _refuse("invalid_batch", str(invalid)[:500])
        return _refuse("clock_skew", skew)
    metrics.INGEST_WIRE.labels(str(batch["v"])).inc()
    # Producers resend a batch byte for byte (the agent its spooled body): the same seq with other bytes is a
    # reused seq. The body's hash costs 1/50 of validating it; a canonical re-encoding would cost half as much.
    return Checked(batch, hashlib.sha256(body).hexdigest())


_mark_looked: dict[tuple[int, str], float] = {}  # (token id, prefix) -> when a request last had tokens.mark_used look at it


def ready_in_loop(token: IngestToken) -> tuple[IngestToken, float] | None:
    """``(token, send interval)`` when :func:`begin` with this cached token needs no query: the token's use was
    recorded within MARK_USED_EVERY_S and the cluster's node count is fresh; else None. Then the ASGI path runs it in
    the event loop, saving the trip to a thread (a tenth of a small batch's cost); otherwise a thread does it (about
    once a minute)."""
    now = time.monotonic()
    if now - _mark_looked.get((token.id, token.prefix), -math.inf) >= tokens.MARK_USED_EVERY_S:
        return None
    if _stale(token.cluster_id, now):
        return None
    seen = _nodes[token.cluster_id]
    return token, _interval(seen[1])


@dataclass(frozen=True)
class Waiting:
    """A batch handed to the group writer: the answer comes once its commit has decided it. ``batch`` is None when
    the writer's process checks the body (its result is then the refusal, or a Stored that names the seq)."""

    future: Future[Stored | Answer]
    batch: dict[str, Any] | None
    send_interval_s: float


def handle_body(headers: Mapping[str, str], body: bytes | None, limit: int) -> Answer:
    """Checks, stores and answers, blocking this thread until the batch's commit (the Django view)."""
    step = begin(headers, body, limit)
    if isinstance(step, Waiting):
        try:
            return finish(step, step.future.result())
        except (DatabaseError, wire.WireError) as exc:
            return finish_failed(step, exc)
    return step


def finish(waiting: Waiting, result: Stored | Answer) -> Answer:
    if isinstance(result, tuple):  # refused by the checks in the writer's process
        return result
    seq, agent_id = (result.seq, result.agent_id) if waiting.batch is None else (waiting.batch["seq"],
                                                                                 waiting.batch["agent_id"])
    if result.status == "seq_reused":
        return _refuse("seq_reused", f"seq {seq} of {agent_id} was already stored with other "
                                     "content; renumber the batch (a seq this agent never used) and send it again")
    return 200, {"status": result.status, "seq": seq, "records": result.records,
                 "send_interval_s": waiting.send_interval_s}, {}


def finish_failed(waiting: Waiting, exc: Exception) -> Answer:
    """The commit failed: a database error is a 503 the agent retries; a batch whose numbers the group writer
    refused (blocks.check_posts) a 400, as any invalid batch; anything else is a bug and raises (500)."""
    if isinstance(exc, DatabaseError):
        return _unavailable(waiting.batch, exc)
    if isinstance(exc, wire.WireError):
        return _refuse("invalid_batch", str(exc)[:500])
    raise exc


def _unavailable(batch: dict[str, Any] | None, exc: Exception) -> Answer:
    if batch is None:
        log.warning("ingest: database unavailable: %s", exc)
    else:
        log.warning("ingest: database unavailable for %s seq %s: %s", batch["agent_id"], batch["seq"], exc)
    return _refuse("unavailable", "database unavailable; the batch was not stored, retry it")


def _busy(interval: float) -> Answer:
    wait = max(1, math.ceil(interval))
    status, body, _ = _refuse("busy", f"the write queue is full; the batch was not stored, send it again in {wait} s")
    return status, {**body, "send_interval_s": interval}, {"Retry-After": str(wait)}


def counted(answer: Answer) -> Answer:
    """Both doors count every answer once: 200s by status, refusals by error code."""
    status, body, _ = answer
    if status == 200:
        metrics.INGEST_ACCEPTED.labels(body["status"]).inc()
    else:
        metrics.INGEST_REFUSED.labels(body.get("error", "unknown")).inc()
    return answer


_nodes: dict[int, tuple[float, int]] = {}  # cluster id -> (when counted, node count)
NODE_COUNT_EVERY_S = 30.0


def send_interval(cluster_id: int) -> float:
    """The least seconds between one agent's posts this server asks for: 1 s until the cluster has more nodes than
    CLUSTERDX_INGEST_NODES_PER_S, then as many seconds as it takes to keep within that budget (agents keep sampling
    at their own interval and send several samples per batch). The node count is re-read every 30 s, and after this
    server created a node of the cluster."""
    now = time.monotonic()
    if _stale(cluster_id, now):
        _nodes[cluster_id] = (now, m.Node.objects.filter(cluster_id=cluster_id).count())
    return _interval(_nodes[cluster_id][1])


def _stale(cluster_id: int, now: float) -> bool:
    """Whether the cluster's node count is due: never counted, counted NODE_COUNT_EVERY_S ago, or before this server
    last created one of its nodes."""
    seen = _nodes.get(cluster_id)
    return seen is None or now - seen[0] >= NODE_COUNT_EVERY_S or seen[0] < NODE_CREATED.get(cluster_id, -math.inf)


def _interval(nodes: int) -> float:
    from django.conf import settings

    budget = int(settings.CLUSTERDX["INGEST_NODES_PER_S"])
    return float(max(1, math.ceil(nodes / budget)))


@csrf_exempt
def ingest(request: HttpRequest) -> HttpResponse:
    """The same door as Django view (the test client, and any deployment that does not use dashboard.asgi)."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    answer = check_request(request.method or "", headers)
    if answer is None:
        limit = _limit()
        answer = handle_body(headers, _read_body(request, limit), limit)
    status, body, extra = counted(answer)
    response = JsonResponse(body, status=status)
    for name, value in extra.items():
        response[name] = value
    return response
