"""Tiered storage: rollups equal the raw samples they summarise (hypothesis; GPU samples seeded as frames, host
samples as rows), a late batch lands in its window exactly once (recomputed while raw holds the window, merged once
retention purged it), retention drops only expired day partitions on PostgreSQL and deletes exactly the expired frames
and rows in chunks on SQLite, and the node series API reads the tier its range needs. Real ingest, real SQL, both
databases."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dashboard.storage import partitions
from dashboard.storage.models import ROLLUPS, GpuRollup1m, GpuRollup10s, HostRollup1m, HostRollup10s, RollupState
from dashboard.storage.retention import purge_tiers
from dashboard.storage.rollup import floor_to, roll_up
from dashboard.telemetry.models import GpuFrame, HostSample, Node
from tests.server import framed
from tests.server.conftest import World, make_batch, post

pytestmark = pytest.mark.django_db

NODE_API = "/api/v1/clusters/prod-a/nodes/{host}/series"


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _expected(rows: list[tuple[Any, ...]], width: int, field_at: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Direct computation: rows are (node_id, key, ts in epoch seconds, write order, value...); per (node, key,
    window) n, min, mean, max, and last (the newest by time, then the last written)."""
    groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for r in rows:
        groups.setdefault((r[0], r[1], math.floor(r[2] / width) * width), []).append(r)
    out = {}
    for key, rs in groups.items():
        vals = [r[field_at] for r in rs if r[field_at] is not None]
        last = max(rs, key=lambda r: (r[2], r[3]))
        out[key] = {"n": len(rs), "min": min(vals, default=None), "max": max(vals, default=None),
                    "mean": sum(vals) / len(vals) if vals else None, "last": last[field_at]}
    return out


def _stored(model: Any, field: str, key: str | None) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for r in model.objects.values():
        out[(r["node_id"], r[key] if key else None, r["ts"].timestamp())] = {
            "n": r["n"], **{s: r[f"{field}_{s}"] for s in ("min", "mean", "max", "last")}}
    return out


def _same(stored: dict[Any, dict[str, Any]], expected: dict[Any, dict[str, Any]]) -> None:
    assert set(stored) == set(expected)
    for key, want in expected.items():
        got = stored[key]
        assert got["n"] == want["n"], key
        for s in ("min", "max", "last", "mean"):
            if want[s] is None:
                assert got[s] is None, (key, s)
            else:
                # PostgreSQL keeps the statistics in single precision (dashboard.storage.models.StatField).
                rel = 1e-6 if connection.vendor == "postgresql" else 1e-9
                assert got[s] == pytest.approx(want[s], rel=rel), (key, s, got, want)


# (node, GPU, ms after the minute, util, ECC count, post): times at window edges and equal times in other posts too.
samples = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1),
                             st.one_of(st.integers(0, 900_000), st.sampled_from([0, 9_999, 10_000, 59_999, 60_000])),
                             st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False)),
                             st.one_of(st.none(), st.integers(0, 2**40)), st.integers(0, 2)),
                   min_size=1, max_size=60)


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples)
def test_rollups_equal_the_raw_samples_they_summarise(world: World, rows: list[tuple[int, int, int, Any, Any, int]]
                                                      ) -> None:
    for model in (GpuFrame, HostSample, RollupState, *[t for _, _, tiers in ROLLUPS.values() for t in tiers.values()]):
        model.objects.all().delete()
    nodes = [Node.objects.get_or_create(cluster=world.cluster, hostname=f"hyp-{i}")[0] for i in range(2)]
    base = floor_to(timezone.now() - timedelta(hours=1), 60).timestamp()
    gpu = []  # (node id, GPU, ts, write order: post then position in it, util, ECC), as seeded
    for p in range(3):  # each node's samples of one post, as ingest frames them; posts in order
        for n, node in enumerate(nodes):
            post = [r for r in rows if r[5] == p and r[0] == n]
            framed.gpus(world.cluster, node, [{"ts": base + ms / 1000, "index": g, "util_gpu_pct": v,
                                               "ecc_sbe_aggregate": c} for _, g, ms, v, c, _ in post])
            gpu += [(node.id, g, base + ms / 1000, (p, i), v, c) for i, (_, g, ms, v, c, _) in enumerate(post)]
    HostSample.objects.bulk_create([  # one host series per node: the GPU index becomes a sub-second offset
        HostSample(cluster=world.cluster, node=nodes[n], ts=_dt(base + ms / 1000 + g * 0.0005), cpu_pct=v)
        for n, g, ms, v, *_ in rows])
    roll_up()

    host = [(n, n, ts.timestamp(), i, cpu)
            for n, ts, i, cpu in HostSample.objects.values_list("node_id", "ts", "id", "cpu_pct")]
    for width, g_model, h_model in ((10, GpuRollup10s, HostRollup10s), (60, GpuRollup1m, HostRollup1m)):
        _same(_stored(g_model, "util_gpu_pct", "gpu_index"), _expected(gpu, width, 4))
        _same(_stored(g_model, "ecc_sbe_aggregate", "gpu_index"), _expected(gpu, width, 5))
        _same({(k[0], k[0], k[2]): v for k, v in _stored(h_model, "cpu_pct", None).items()}, _expected(host, width, 4))

    # Running it again (a duplicated task, a pass over windows already done) changes nothing, and rewrites nothing.
    before = sorted(GpuRollup10s.objects.values_list("node_id", "gpu_index", "ts", "n", "util_gpu_pct_mean"))
    RollupState.objects.all().delete()
    assert roll_up() == 0, "a window whose samples are those already rolled up is not rewritten"
    assert sorted(GpuRollup10s.objects.values_list("node_id", "gpu_index", "ts", "n", "util_gpu_pct_mean")) == before


def _late(client: Any, world: World, seq: int, at: float, util: float) -> None:
    batch = make_batch(seq=seq, host="node-000", sent_at=at + 1, steps=[])
    for g in batch["gpus"]:
        g.update(ts=at, util_gpu_pct=util)
    r = post(client, batch, world.token)
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.content


def _window(t: float) -> tuple[int, float, float, float, float | None]:
    row = GpuRollup1m.objects.get(gpu_index=0, ts=floor_to(_dt(t), 60))
    return row.n, row.util_gpu_pct_min, row.util_gpu_pct_mean, row.util_gpu_pct_max, row.util_gpu_pct_last


def test_a_late_batch_lands_in_its_window_once(client: Any, world: World) -> None:
    minute = floor_to(timezone.now() - timedelta(minutes=30), 60).timestamp()
    _late(client, world, 1, minute + 10, 20.0)
    _late(client, world, 2, minute + 40, 40.0)
    roll_up()
    assert _window(minute) == (2, 20.0, 30.0, 40.0, 40.0)
    assert GpuRollup10s.objects.filter(gpu_index=0).count() == 2

    # Batch 3 was spooled through an outage: its sample is from the middle of that minute, rolled up long ago.
    _late(client, world, 3, minute + 30, 90.0)
    roll_up()
    assert _window(minute) == (3, 20.0, 50.0, 90.0, 40.0)
    roll_up()
    assert _window(minute) == (3, 20.0, 50.0, 90.0, 40.0), "a second pass must not count anything twice"

    # Retention purged that minute's raw samples; a batch later still is merged in, once, and leaves raw.
    GpuFrame.objects.all().delete()
    RollupState.objects.update(raw_purged_through=_dt(minute + 60))
    _late(client, world, 4, minute + 50, 10.0)
    assert GpuFrame.objects.count() == 1
    roll_up()
    assert _window(minute) == (4, 10.0, 40.0, 90.0, 10.0)
    assert not GpuFrame.objects.exists(), "merged late frames are removed from raw in the same transaction"
    roll_up()
    assert _window(minute) == (4, 10.0, 40.0, 90.0, 10.0)
    assert GpuRollup10s.objects.get(gpu_index=0, ts=_dt(minute + 50)).util_gpu_pct_max == 10.0


def test_late_frames_hours_apart_before_the_purge_line_are_each_merged_once(client: Any, world: World) -> None:
    """The merge reads late frames a span at a time: frames hours apart, one into a window already rolled up and one
    into a window that never was, are each merged once and leave raw."""
    hour = floor_to(timezone.now() - timedelta(hours=5), 60).timestamp()
    _late(client, world, 1, hour + 10, 20.0)
    roll_up()
    GpuFrame.objects.all().delete()  # retention purged the raw samples up to four hours after it
    RollupState.objects.update(raw_purged_through=_dt(hour + 4 * 3600))
    _late(client, world, 2, hour + 20, 40.0)
    _late(client, world, 3, hour + 3 * 3600 + 5, 70.0)
    for _ in range(2):
        roll_up()
        assert _window(hour) == (2, 20.0, 30.0, 40.0, 40.0)
        assert _window(hour + 3 * 3600) == (1, 70.0, 70.0, 70.0, 70.0)
        assert not GpuFrame.objects.exists()


def _rows_at(world: World, node: Node, times: list[datetime]) -> None:
    """A GPU sample at each of ``times``, as frames (one post: a frame each, minutes apart)."""
    framed.gpus(world.cluster, node, [{"ts": t, "index": 0, "util_gpu_pct": 1.0} for t in times])


def _kept(model: Any) -> list[datetime]:
    """The times of the samples left in ``model`` (GPU frames: one sample each here)."""
    return sorted(model.objects.values_list("ts", flat=True))


RAW_GPU = ("telemetry_gpuframe",)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="day partitions are PostgreSQL's (SQLite: next test)")
def test_retention_drops_only_expired_partitions(world: World, settings: Any) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-p")
    now = timezone.now()
    today = now.date()
    days = [today - timedelta(days=d) for d in (3, 2, 1, 0)]
    with connection.cursor() as cursor:
        for table in RAW_GPU:
            partitions.ensure_partitions(cursor, table, days)
    noon = [datetime(d.year, d.month, d.day, 12, tzinfo=UTC) for d in days]
    stray = now - timedelta(days=10)  # a day without a partition: the frame waits in the default one
    _rows_at(world, node, [*noon, stray])
    # The hot window ends inside yesterday: yesterday's partition is kept whole, the two before it go.
    settings.CLUSTERDX = {**settings.CLUSTERDX, "RAW_RETENTION_HOURS": (now - noon[2]).total_seconds() / 3600 + 1}
    with connection.cursor() as cursor:  # the rows were committed days ago in life; here, in this test's transaction
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    with CaptureQueriesContext(connection) as ctx:
        purge_tiers(now, chunk=50)
    sql = [q["sql"] for q in ctx.captured_queries]
    for table in RAW_GPU:
        with connection.cursor() as cursor:
            left = set(partitions.partitions(cursor, table))
        assert {today - timedelta(days=3), today - timedelta(days=2)}.isdisjoint(left) and {days[2], days[3]} <= left
        assert not [s for s in sql if s.startswith(f'DELETE FROM "{table}"') or
                    s.startswith(f"DELETE FROM {table} ")], f"{table} is never DELETEd from"
    assert _kept(GpuFrame) == noon[2:]
    assert [s for s in sql if s.startswith("DROP TABLE")] == [
        f'DROP TABLE "{table}_p{d:%Y%m%d}"' for table in RAW_GPU for d in days[:2]]
    assert RollupState.objects.get().raw_purged_through == datetime(days[2].year, days[2].month, days[2].day, tzinfo=UTC)
    # A frame for a day whose partition is made later moves out of the default partition with it.
    _rows_at(world, node, [stray + timedelta(days=8)])
    with connection.cursor() as cursor:
        for table in RAW_GPU:
            partitions.ensure_partitions(cursor, table, [(stray + timedelta(days=8)).date()])
            cursor.execute(f"SELECT count(*) FROM {table}_default")
            assert cursor.fetchone()[0] == 0
    assert GpuFrame.objects.count() == 3


@pytest.mark.skipif(connection.vendor != "postgresql", reason="TOAST is PostgreSQL's")
def test_a_frame_up_to_a_page_stays_in_its_row_in_every_partition(world: World) -> None:
    """Frames are LZ4 already: PostgreSQL must neither try to compress them again nor move them out of line (a TOAST
    row and index entry per insert, a second lookup per read), in a partition made at migration, one made later
    with rows moved out of the default partition, or the default partition itself."""
    import os

    from dashboard.storage import frames

    assert set(partitions.STORAGE) == {k.model._meta.db_table for k in frames.KINDS.values()}, "every frame table"
    node = Node.objects.create(cluster=world.cluster, hostname="node-t")
    now = timezone.now()
    later = now + timedelta(days=30)  # no partition yet: lands in the default one, then gets its own
    stray = now + timedelta(days=300)  # stays in the default one

    def frame(at: datetime) -> None:
        GpuFrame.objects.create(cluster=world.cluster, node=node, ts=at, n=1, data=os.urandom(6000))

    for at in (now, later, stray):
        frame(at)
    with connection.cursor() as cursor:
        partitions.ensure_partitions(cursor, "telemetry_gpuframe", [later.date()])
        frame(later)
        held = [partitions.partition_name("telemetry_gpuframe", d) for d in (now.date(), later.date())]
        for name in [*held, "telemetry_gpuframe_default"]:
            cursor.execute("SELECT c.reloptions, pg_relation_size(c.reltoastrelid), "
                           "(SELECT count(*) FROM telemetry_gpuframe WHERE tableoid = c.oid) "
                           "FROM pg_class c WHERE c.relname = %s", [name])
            options, toasted, rows = cursor.fetchone()
            assert "toast_tuple_target=8160" in options, name
            assert rows >= 1 and toasted == 0, f"{name}: {rows} frames of 6,000 bytes, {toasted} bytes out of line"


@pytest.mark.skipif(connection.vendor == "postgresql", reason="PostgreSQL drops partitions (previous test)")
def test_retention_deletes_exactly_the_expired_frames_in_chunks(world: World, settings: Any) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-s")
    now = timezone.now()
    times = [now - timedelta(minutes=m, seconds=7) for m in range(0, 180, 1)]
    _rows_at(world, node, times)
    settings.CLUSTERDX = {**settings.CLUSTERDX, "RAW_RETENTION_HOURS": 1.0}
    cut = floor_to(now - timedelta(hours=1), 60)  # aligned to the minute: no rollup window is half purged
    with CaptureQueriesContext(connection) as ctx:
        purge_tiers(now, chunk=50)
    for table in RAW_GPU:
        deletes = [q["sql"] for q in ctx.captured_queries if q["sql"].startswith(f'DELETE FROM "{table}"')]
        assert len(deletes) >= 2 and all(" IN (" in s for s in deletes), table
    assert _kept(GpuFrame) == sorted(t for t in times if t >= cut)
    assert RollupState.objects.get().raw_purged_through == cut
    purged = {floor_to(t, 60) for t in times if t < cut}
    assert set(GpuRollup1m.objects.filter(ts__lt=cut).values_list("ts", flat=True)) == purged, \
        "what retention purged was rolled up first"


def test_the_series_api_reads_the_tier_its_range_needs(client: Any, world: World, settings: Any) -> None:
    node = Node.objects.create(cluster=world.cluster, hostname="node-t")
    now = time.time()
    start = math.floor((now - 3 * 3600) / 60) * 60
    framed.gpus(world.cluster, node, [{"ts": start + 5 * i, "index": 0, "util_gpu_pct": float(i % 97)}
                                      for i in range(int((now - start) / 5) - 24)])  # up to two minutes ago
    client.force_login(world.owner)

    def get(**params: Any) -> dict[str, Any]:
        r = client.get(NODE_API.format(host="node-t"), {"gpu": 0, **params})
        assert r.status_code == 200, r.content
        return dict(r.json())

    assert get(range="24h")["range"]["tier"] == "raw", "no rollup pass yet: raw rows are all there is"
    roll_up()
    framed.gpus(world.cluster, node, [{"ts": time.time(), "index": 0, "util_gpu_pct": 99.0}])

    for name, tier, step in (("15m", "raw", 1), ("6h", "10s", 10), ("24h", "1m", 60)):
        body = get(range=name)
        series = body["gpus"]["0"]["util_gpu_pct"]
        assert body["range"]["tier"] == tier and body["range"]["bucket_s"] % step == 0, body["range"]
        assert max(series["max"]) == 99.0, f"{name}: the sample after the last rollup pass is read raw"
        assert len(body["gpus"]["0"]["t"]) <= 1500
    # The same buckets from the rollups as from raw rows: 6 h in 20 s buckets, read both ways.
    span = {"from": now - 6 * 3600, "to": now, "points": 1080}
    tiered = get(**span)
    through = RollupState.objects.get().rolled_through
    RollupState.objects.update(rolled_through=None)
    raw = get(**span)
    assert (tiered["range"]["tier"], raw["range"]["tier"]) == ("10s", "raw")
    a, b = tiered["gpus"]["0"], raw["gpus"]["0"]
    assert a["t"] == b["t"] and a["util_gpu_pct"]["min"] == b["util_gpu_pct"]["min"]
    assert a["util_gpu_pct"]["max"] == b["util_gpu_pct"]["max"]
    assert a["util_gpu_pct"]["mean"] == pytest.approx(b["util_gpu_pct"]["mean"], rel=1e-3)  # 4 significant digits
    RollupState.objects.update(rolled_through=through)
    # A past hour beyond the hot window is read from the 10 s rollups even though 2 s buckets were asked for.
    settings.CLUSTERDX = {**settings.CLUSTERDX, "RAW_RETENTION_HOURS": 1.0}
    past = get(**{"from": start + 60, "to": start + 3660})
    assert past["range"]["tier"] == "10s" and past["range"]["bucket_s"] == 10
    assert past["gpus"]["0"]["t"] == [start + 60 + 10 * i for i in range(361)]  # both ends are in the range


def test_a_value_beyond_single_precision_never_blocks_a_pass(world: World) -> None:
    """PostgreSQL keeps statistics as ``real``: a wild value (a driver bug, a counter gone mad) must be clamped, or
    the window would be refused on every pass, and the node's rollups with it."""
    node = Node.objects.create(cluster=world.cluster, hostname="node-w")
    at = floor_to(timezone.now() - timedelta(minutes=5), 60)
    framed.gpus(world.cluster, node, [{"ts": at, "index": 0, "power_w": 1e300, "temp_c": 1e-300},
                                      {"ts": at + timedelta(seconds=1), "index": 0, "power_w": -1e300}])
    roll_up()
    row = GpuRollup10s.objects.get(node=node)
    big = 3.4e38 if connection.vendor == "postgresql" else 1e300
    assert row.n == 2
    assert (row.power_w_max, row.power_w_min, row.power_w_last) == pytest.approx((big, -big, -big), rel=1e-6)
    assert row.temp_c_min == (0.0 if connection.vendor == "postgresql" else 1e-300)


def _past_hour(settings: Any) -> tuple[float, float]:
    """An hour that ended two hours ago, beyond a 1 h hot window: the pages must read it from the rollups."""
    settings.CLUSTERDX = {**settings.CLUSTERDX, "RAW_RETENTION_HOURS": 1.0}
    base = floor_to(timezone.now() - timedelta(hours=3), 60).timestamp()
    return base, base + 3600


def test_finding_evidence_beyond_the_hot_window_is_drawn_from_the_rollups(world: World, settings: Any) -> None:
    from dashboard.diagnosis.models import Finding
    from dashboard.web.evidence import chart

    node = Node.objects.create(cluster=world.cluster, hostname="node-e")
    base, _ = _past_hour(settings)
    change = base + 1800  # the clock drops from half its max to 30% half-way through the hour
    framed.gpus(world.cluster, node, [{"ts": base + s, "index": 0, "temp_c": 80.0, "sm_clock_max_mhz": 2000.0,
                                       "sm_clock_mhz": 1000.0 if base + s < change else 600.0}
                                      for s in range(0, 3600, 2)])
    roll_up()
    GpuFrame.objects.all().delete()  # retention purged the raw samples
    at = _dt(change)
    f = Finding.objects.create(cluster=world.cluster, kind="throttling", subject_type="gpu", subject="node-e/gpu0",
                               node=node, gpu_index=0, severity="warning", title="node-e gpu0 throttles", action="Cool it",
                               evidence={"metrics": {"clock_ratio": 0.3}, "window": [change, change + 600]},
                               opened_at=at, updated_at=at, last_seen_at=_dt(change + 600))
    clock = next(p for p in chart(f)["panels"] if p["id"] == "clock")
    xs, ys = clock["series"][0]["x"], clock["series"][0]["y"]
    assert xs and all(x % 10 == 0 for x in xs), "10 s rollup windows"
    assert {round(y, 6) for y, x in zip(ys, xs, strict=True) if x < change} == {0.5}
    assert {round(y, 6) for y, x in zip(ys, xs, strict=True) if x >= change} == {0.3}
    assert (xs[0], xs[-1]) == (change - 600, change + 750), "the finding's context range (evidence.context_range)"


def test_the_link_page_reads_host_cpu_beyond_the_hot_window_from_the_rollups(client: Any, world: World,
                                                                              settings: Any) -> None:
    nodes = [Node.objects.create(cluster=world.cluster, hostname=h) for h in ("lnk-a", "lnk-b")]
    base, end = _past_hour(settings)
    HostSample.objects.bulk_create([HostSample(cluster=world.cluster, node=n, ts=_dt(base + s), cpu_pct=cpu)
                                    for n, cpu in zip(nodes, (90.0, 10.0), strict=True) for s in range(0, 3600, 5)])
    roll_up()
    HostSample.objects.all().delete()
    client.force_login(world.owner)
    r = client.get("/api/v1/clusters/prod-a/links/lnk-a/lnk-b/series", {"from": base, "to": end})
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["cpu_range"]["tier"] == "10s" and body["cpu_range"]["bucket_s"] == 10
    for host, cpu in (("lnk-a", 90.0), ("lnk-b", 10.0)):
        series = body["cpu"][host]
        assert series["t"] == [base + 10 * i for i in range(360)]
        assert set(series["cpu_pct"]["mean"]) == {cpu} and set(series["cpu_pct"]["max"]) == {cpu}
