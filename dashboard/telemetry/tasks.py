"""Retention: time series older than their retention are removed, and so are the idempotency records (AgentBatch)
older than RETENTION_HOURS, but for one per agent.

Which series keep how long (dashboard.storage): raw GPU and host samples the hot window (RAW_RETENTION_HOURS), their
10 s and 1 min rollups ROLLUP_*_RETENTION_DAYS; ports, steps, probes and events RETENTION_HOURS (they are not rolled
up: the link and run pages read them raw). On PostgreSQL all of these but events are partitioned by day and retention
drops whole partitions; events are few and deleted in chunks; on SQLite every table is deleted in chunks.

That one is the agent's *mark*: its highest seq among the purged records. Seqs only grow for an agent's lifetime
(:mod:`clusterdx.wire`), so a seq at or below the mark was either stored and purged, or is older than retention;
ingest answers it as a duplicate (:func:`purged_through`) instead of storing a late retry a second time. Keeping one
small row per agent costs nothing next to its time series; marks of agents silent for ``MARK_KEEP`` (a reimaged
node, a finished training process posting directly) go too, after which a retry that late would be stored again.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from celery import shared_task
from django.conf import settings
from django.db import connection
from django.db.models import Q, QuerySet
from django.utils import timezone

from dashboard.telemetry import models as m

# kept RETENTION_HOURS; GPU and host: dashboard.storage
LONG_SERIES = (m.PortSample, m.StepFrame, m.ProbeFrame, m.ProbeInbound, m.Event)
MARK_KEEP = timedelta(days=30)


def cutoff() -> datetime:
    return timezone.now() - timedelta(hours=settings.CLUSTERDX["RETENTION_HOURS"])


@shared_task(name="dashboard.telemetry.tasks.purge_old_samples")
def purge_old_samples(chunk: int = 50_000) -> int:
    from dashboard.storage import retention

    before = cutoff()
    retention.ensure_ahead([*LONG_SERIES, *retention.rolled_tables()])
    deleted = retention.purge_tiers(timezone.now(), chunk)
    for model in LONG_SERIES:
        deleted += retention.purge(model, before, chunk)[1]
    for cluster_id in m.Cluster.objects.values_list("id", flat=True):
        _purge_batches(cluster_id, before, chunk)
        _purge(m.AgentBatch.objects.filter(cluster_id=cluster_id, received_at__lt=timezone.now() - MARK_KEEP), chunk)
    return deleted


def _purge(rows: QuerySet, chunk: int) -> int:
    """Chunked, so a long outage of the task never turns into one giant, lock-holding DELETE (on either database)."""
    deleted = 0
    while True:
        ids = list(rows.values_list("id", flat=True)[:chunk])
        if not ids:
            return deleted
        deleted += rows.model.objects.filter(id__in=ids).delete()[0]


def _purge_batches(cluster_id: int, before: datetime, chunk: int) -> None:
    """Delete the cluster's records older than ``before``, keeping each agent's highest seq among them (its mark).

    One pass in (received_at, id) order over the index on (cluster, received_at): no per-agent query, and an
    earlier pass's mark is superseded (deleted) as soon as a higher old seq of its agent comes by."""
    old = m.AgentBatch.objects.filter(cluster_id=cluster_id, received_at__lt=before)
    marks: dict[str, tuple[int, int]] = {}  # agent_id -> (seq, id) of its highest old record so far
    page = old
    while True:
        rows = list(page.order_by("received_at", "id").values_list("id", "agent_id", "seq", "received_at")[:chunk])
        if not rows:
            return
        doomed = []
        for pk, agent_id, seq, _ in rows:
            best = marks.get(agent_id)
            if best is not None and best[0] >= seq:
                doomed.append(pk)
                continue
            if best is not None:
                doomed.append(best[1])
            marks[agent_id] = (seq, pk)
        if doomed:
            m.AgentBatch.objects.filter(id__in=doomed).delete()
        _, _, _, at = rows[-1]
        page = old.filter(Q(received_at__gt=at) | Q(received_at=at, id__gt=rows[-1][0]))


def purged_through(cluster_id: int, agent_id: str, seq: int) -> bool:
    """True when ``seq`` is at or below the agent's mark: its record may have been purged, so it is a duplicate.

    Any record of the agent past the cutoff with a higher seq will do (the mark, or one retention has not reached
    yet). The unique index on (cluster, agent_id, seq) makes this one probe for a new batch, whose seq is the
    agent's highest; only a retry walks the few records stored after it."""
    return m.AgentBatch.objects.filter(cluster_id=cluster_id, agent_id=agent_id, seq__gt=seq,
                                       received_at__lt=cutoff()).exists()


def purged_among(keys: list[tuple[int, str, int]]) -> set[tuple[int, str, int]]:
    """:func:`purged_through` for many (cluster id, agent id, seq) at once: the keys at or below their agent's mark.

    One statement per 500 keys, each key its own index range (OR of (cluster, agent, seq >) probes: a new batch's
    range is empty): a server restarting under 2,048 agents asked once per agent, 2,048 queries in its first seconds."""
    out: set[tuple[int, str, int]] = set()
    if not keys:  # every group once the server has committed for its agents: nothing to ask
        return out
    quote = connection.ops.quote_name
    table = quote(m.AgentBatch._meta.db_table)
    cluster, agent, seq_, received = (quote(m.AgentBatch._meta.get_field(f).column)
                                      for f in ("cluster", "agent_id", "seq", "received_at"))
    before = connection.ops.adapt_datetimefield_value(cutoff())
    for start in range(0, len(keys), 500):
        part = keys[start:start + 500]
        # SQL of its own: the ORM compiling 500 OR'ed lookups cost ~0.5 ms each, a second at 2,048 agents.
        terms = " OR ".join([f"({cluster} = %s AND {agent} = %s AND {seq_} > %s)"] * len(part))
        params: list[object] = [before]
        for key in part:
            params += key
        above: dict[tuple[int, str], int] = {}  # (cluster, agent) -> the highest seq of its old records found
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {cluster}, {agent}, {seq_} FROM {table} WHERE {received} < %s AND ({terms})",
                           params)
            for cluster_id, agent_id, seq in cursor.fetchall():
                above[(cluster_id, agent_id)] = max(seq, above.get((cluster_id, agent_id), seq))
        out |= {k for k in part if above.get(k[:2], -1) > k[2]}
    return out
