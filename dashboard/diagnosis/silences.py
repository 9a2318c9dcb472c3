"""Acknowledgements and silences: who is on a finding, and which subjects alert nothing for a while.

An acknowledgement sits on the finding row (it ends when the row resolves; a condition that comes back opens a new
row, which alerts again). A silence names a subject (a node under maintenance, a GPU, a link, a run, a finding
kind) until an end time: findings about it still open and show, marked silenced, but the alert planner holds back
their alerts; when the silence ends, the alert sweep sends what it held back for findings still open.

What a silence covers is decided by :func:`covers`, a pure function over a finding's facts (the same dict shape
that pages list, :func:`dashboard.diagnosis.live.finding_row`), so the planner, the pages and the tests agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from dashboard.diagnosis.models import Finding, Silence
from dashboard.telemetry.models import Cluster, Node, Run

MAX_DURATION = timedelta(days=30)  # a silence longer than this is a disabled alert in disguise
SCOPES = list(Silence.Scope.values)


class Refused(ValueError):
    """A silence or acknowledgement that cannot be made as asked; the message says why (answered 400)."""


# -- what a silence covers (pure) -------------------------------------------------------------------------------------
def covers(scope: str, target: str, row: Mapping[str, Any]) -> bool:
    """Whether a silence of ``scope``/``target`` covers the finding described by ``row`` (kind, subject_type,
    subject, node, gpu_index, run)."""
    if scope == Silence.Scope.KIND:
        return row.get("kind") == target
    if scope == Silence.Scope.RUN:
        return row.get("run") is not None and str(row.get("run")) == target
    ends = str(row.get("subject", "")).split("~") if row.get("subject_type") == "link" else []
    if scope == Silence.Scope.NODE:
        # A node in maintenance: everything about it, its GPUs and ranks, and every link it is an end of.
        return row.get("node") == target or target in ends or row.get("subject") == target
    if scope == Silence.Scope.GPU:
        host, _, index = target.rpartition("/gpu")
        return row.get("node") == host and row.get("gpu_index") is not None and str(row.get("gpu_index")) == index
    if scope == Silence.Scope.LINK:
        return len(ends) == 2 and sorted(ends) == sorted(target.split("~"))
    return False


def facts(f: Finding) -> dict[str, Any]:
    """The part of a finding that :func:`covers` reads, without the page row's links and headline."""
    return {"kind": f.kind, "subject_type": f.subject_type, "subject": f.subject, "run": f.run_id,
            "node": f.node.hostname if f.node_id else None, "gpu_index": f.gpu_index}


def active(cluster_ids: Iterable[int], now: datetime | None = None) -> list[Silence]:
    now = now or timezone.now()
    return list(Silence.objects.filter(cluster_id__in=list(cluster_ids), starts_at__lte=now, ends_at__gt=now)
                .order_by("-ends_at"))


def covering(row: Mapping[str, Any], silences: Iterable[Silence]) -> Silence | None:
    """The silence that holds ``row`` back longest (``silences`` newest end first, as :func:`active` gives them)."""
    return next((s for s in silences if s.cluster_id == row.get("cluster_id") and covers(s.scope, s.target, row)),
                None)


def silence_info(s: Silence) -> dict[str, Any]:
    return {"id": s.id, "scope": s.scope, "target": s.target, "reason": s.reason, "by": s.created_by_name,
            "starts_at": s.starts_at.timestamp(), "ends_at": s.ends_at.timestamp(),
            "created_at": s.created_at.timestamp() if s.created_at else None, "ended_by": s.ended_by_name or None}


def mark(rows: list[dict[str, Any]], silences: list[Silence] | None = None) -> list[dict[str, Any]]:
    """Add ``silenced`` (the covering silence, or None) to finding rows; one query for all of them."""
    if silences is None:
        silences = active({r["cluster_id"] for r in rows if r.get("cluster_id") is not None}) if rows else []
    for row in rows:
        s = covering(row, silences) if row.get("state", "open") == "open" else None  # a resolved one sends nothing
        row["silenced"] = None if s is None else {"id": s.id, "until": s.ends_at.timestamp(), "reason": s.reason,
                                                  "by": s.created_by_name}
    return rows


def held_back(f: Finding, now: datetime | None = None) -> str | None:
    """Why an alert about ``f`` (opened or escalated) is not to be sent, or None. Read fresh: the finding object a
    detector signalled with predates a click made during its pass."""
    ack = Finding.objects.filter(id=f.id).values("acked_at", "acked_by_name").first()
    if ack and ack["acked_at"] is not None:
        return f"acknowledged by {ack['acked_by_name']} at {ack['acked_at']:%Y-%m-%d %H:%M:%S} UTC: no more alerts " \
               "until it resolves"
    s = covering({**facts(f), "cluster_id": f.cluster_id}, active([f.cluster_id], now))
    if s is not None:
        return f"silenced until {s.ends_at:%Y-%m-%d %H:%M} UTC by {s.created_by_name} (silence {s.id}): {s.reason}"
    return None


# -- changes (each audited, each pushed to the pages) -----------------------------------------------------------------
def _actor_name(user: Any) -> str:
    return (getattr(user, "username", "") or str(user))[:150]


def _push(cluster_id: int, findings: Iterable[Finding]) -> None:
    """Tell the open pages, after the commit, that these findings changed (acked, silenced or no longer)."""
    from dashboard.diagnosis.live import finding_row
    from dashboard.live.broadcast import broadcast, cluster_group

    rows = mark([finding_row(f) for f in findings])
    if rows:
        transaction.on_commit(lambda: broadcast(cluster_group(cluster_id),
                                                {"type": "findings", "cluster": cluster_id, "findings": rows}))


def acknowledge(f: Finding, user: Any, *, on: bool = True) -> bool:
    """Acknowledge an open finding (``on=False``: take the acknowledgement back). False when nothing changed: the
    finding is resolved, or already in that state (a double click is harmless)."""
    from dashboard.telemetry.audit import record

    qs = Finding.objects.filter(id=f.id, state=Finding.State.OPEN)
    with transaction.atomic():
        if on:
            changed = qs.filter(acked_at=None).update(acked_at=timezone.now(), acked_by=user,
                                                     acked_by_name=_actor_name(user))
        else:
            changed = qs.exclude(acked_at=None).update(acked_at=None, acked_by=None, acked_by_name="")
        if not changed:
            return False
        f.refresh_from_db()
        record(user, "finding.ack" if on else "finding.unack", cluster=f.cluster, target=f"finding {f.id}",
               kind=f.kind, subject=f.subject)
        _push(f.cluster_id, [f])
    return True


def parse_target(cluster: Cluster, scope: str, raw: str) -> str:
    """The stored target for what a person typed, checked against the cluster (a typo would silence nothing)."""
    from dashboard.diagnosis.detectors import KINDS

    raw = (raw or "").strip()
    hosts = Node.objects.filter(cluster=cluster)
    if scope == Silence.Scope.NODE:
        if not hosts.filter(hostname=raw).exists():
            raise Refused(f"no node named {raw[:80]!r} in {cluster.name}")
        return raw
    if scope == Silence.Scope.GPU:
        host, _, index = raw.rpartition("/gpu")
        if not (index.isascii() and index.isdigit() and len(index) <= 3) or not hosts.filter(hostname=host).exists():
            raise Refused(f"a GPU is named <host>/gpu<index> with a node of {cluster.name}, got {raw[:80]!r}")
        return f"{host}/gpu{int(index)}"
    if scope == Silence.Scope.LINK:
        ends = sorted(raw.split("~"))
        if len(ends) != 2 or ends[0] == ends[1] or hosts.filter(hostname__in=ends).count() != 2:
            raise Refused(f"a link is named <host>~<host> with two nodes of {cluster.name}, got {raw[:80]!r}")
        return "~".join(ends)
    if scope == Silence.Scope.RUN:
        run = Run.objects.filter(cluster=cluster, id=int(raw)).first() if raw.isascii() and raw.isdigit() and \
            len(raw) <= 18 else Run.objects.filter(cluster=cluster, name=raw).order_by("-id").first()
        if run is None:
            raise Refused(f"no run {raw[:80]!r} in {cluster.name}")
        return str(run.id)
    if scope == Silence.Scope.KIND:
        if raw not in KINDS:
            raise Refused(f"kind must be one of {', '.join(KINDS)}, got {raw[:80]!r}")
        return raw
    raise Refused(f"scope must be one of {', '.join(SCOPES)}, got {str(scope)[:40]!r}")


def _covered_open(cluster_id: int, scope: str, target: str) -> list[Finding]:
    qs = Finding.objects.filter(cluster_id=cluster_id, state=Finding.State.OPEN).select_related("cluster", "node",
                                                                                                 "peer_node")
    return [f for f in qs if covers(scope, target, facts(f))]


def create_silence(cluster: Cluster, user: Any, scope: str, target: str, minutes: float, reason: str) -> Silence:
    """Silence ``target`` for ``minutes`` from now. Raises :class:`Refused` with the reason for bad input."""
    from dashboard.telemetry.audit import record

    if scope not in SCOPES:
        raise Refused(f"scope must be one of {', '.join(SCOPES)}, got {str(scope)[:40]!r}")
    if not isinstance(minutes, int | float) or isinstance(minutes, bool) or not 1 <= minutes <= \
            MAX_DURATION.total_seconds() / 60:
        raise Refused(f"minutes must be a number from 1 to {int(MAX_DURATION.total_seconds() // 60)} (30 days)")
    reason = (reason or "").strip()
    if not reason or len(reason) > 500:
        raise Refused("a reason is required (at most 500 characters): the next person on call reads it")
    stored = parse_target(cluster, scope, target)
    now = timezone.now()
    with transaction.atomic():
        s = Silence.objects.create(cluster=cluster, scope=scope, target=stored, reason=reason, starts_at=now,
                                   ends_at=now + timedelta(minutes=minutes), created_by=user,
                                   created_by_name=_actor_name(user))
        record(user, "silence.create", cluster=cluster, target=f"{scope} {stored}", silence=s.id, reason=reason,
               ends_at=s.ends_at.isoformat())
        _push(cluster.id, _covered_open(cluster.id, scope, stored))
    return s


def end_silence(s: Silence, user: Any) -> bool:
    """End a silence now; the alert sweep then sends what it held back. False when it had already ended."""
    from dashboard.telemetry.audit import record

    now = timezone.now()
    with transaction.atomic():
        if not Silence.objects.filter(id=s.id, ends_at__gt=now).update(ends_at=now, ended_by_name=_actor_name(user)):
            return False
        s.refresh_from_db()
        record(user, "silence.end", cluster=s.cluster, target=f"{s.scope} {s.target}", silence=s.id)
        _push(s.cluster_id, _covered_open(s.cluster_id, s.scope, s.target))
    return True
