"""Nothing the wire carries is silently dropped by the server: every record field has a column or a stated
reason, and every list of a batch has a consumer."""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

import pytest

from clusterdx import blocks, wire
from dashboard.ingest import blocks as server_blocks
from dashboard.ingest import views, writer
from dashboard.live import publish
from dashboard.storage import frames as fr
from dashboard.telemetry import models as m

TABLES = {wire.HostSample: m.HostSample, wire.PortSample: m.PortSample, wire.Event: m.Event}
# The framed records' fields that are not a frame's number or object field, and where they go instead.
FRAMED_ELSEWHERE = {"gpus": {"uuid", "name", "pci_bus_id"},  # the GPU inventory (telemetry.Gpu)
                    "steps": {"run"}, "probes": set()}  # a step frame's run column


@pytest.mark.parametrize("record", list(TABLES), ids=lambda r: r.__name__)
def test_every_wire_field_has_a_column(record: type[wire.Record]) -> None:
    columns = {f.name for f in TABLES[record]._meta.get_fields()}
    stored = set(wire.field_names(record)) - writer.WIRE_NOT_COLUMNS[record]
    assert stored <= columns, f"wire fields with no column: {stored - columns}"
    assert writer.WIRE_NOT_COLUMNS[record] <= set(wire.field_names(record)), "stale exceptions"


@pytest.mark.parametrize("kind", sorted(fr.KINDS))
def test_every_field_of_a_framed_record_is_kept(kind: str) -> None:
    record = blocks.BLOCKED[kind]
    k = fr.KINDS[kind]
    kept = set(k.numbers) | set(k.objects) | FRAMED_ELSEWHERE[kind]
    assert set(wire.field_names(record)) == kept, (set(wire.field_names(record)) ^ kept)


def test_every_list_of_a_batch_is_consumed() -> None:
    consumers = inspect.getsource(views) + inspect.getsource(writer) + inspect.getsource(publish)
    # The framed kinds are read by the writer's frames loop, each under its kind's name.
    assert "for kind in frames.KINDS.values():" in consumers and "batch[kind.name]" in consumers
    for name in set(wire.field_names(wire.Batch)) - {"v"}:  # the validator consumes the version
        assert f'batch["{name}"]' in consumers or f"'{name}'" in consumers or name in fr.KINDS, \
            f"nothing reads batch[{name!r}]"


ROWS = [(m.HostSample, "ts"), (m.Event, "kind")]


def _framed(kind: fr.Kind, cluster: m.Cluster) -> list[tuple[Any, ...]]:
    """The cluster's stored samples of ``kind``, a tuple each (numbers as stored, NaN as None, then the object fields
    and the frame's run), in a canonical order."""
    got = fr.read(kind, cluster_id=cluster.id, cols=("run_id",) if kind is fr.STEPS else (), objects=kind.objects)
    runs = dict(m.Run.objects.filter(cluster=cluster).values_list("id", "name"))
    out = []
    for i in range(len(got)):
        nums = tuple(None if v != v else v for v in got.mat[i].tolist())
        out.append((*nums, *(json.dumps(got.objs[f][i], sort_keys=True) for f in kind.objects),
                    runs[int(got["run_id"][i])] if kind is fr.STEPS else None))
    return sorted(out, key=repr)


@pytest.mark.django_db
def test_the_records_ingest_keeps_are_stored_and_published_as_their_dicts_would_be() -> None:
    """The ingest path keeps a batch's GPU samples, steps and probes as the compiled decoder's records
    (wire.parse_batch's keep_records), or as version 2's blocks when the post is one; in-process producers and the
    reference path hand dicts. All three must give the same frames, rows, inventory and live messages."""
    now = time.time()
    batch = {"v": 1, "agent_id": "a", "seq": 0, "host": "node-1", "sent_at": now, "gpus": [
        {"ts": now, "index": i, "uuid": f"GPU-{i}", "name": "H200", "pci_bus_id": f"0000:{i:02x}:00.0",
         "util_gpu_pct": 40.0 + i, "mem_used_bytes": 2**34 + i, "temp_c": None, "power_w": 500.5,
         "throttle_reasons": ["sw_power_cap"] if i else [], "ecc_dbe_volatile": i, "remap_pending": bool(i),
         "nvlink_links_up": 18, "unavailable": {"pcie_gen": "not supported"} if i == 2 else None} for i in range(4)],
        "steps": [{"run": "r1" if i < 2 else "r2", "rank": i, "step": 9 + i, "ts": now - 1 + i / 10, "step_time_s": 1.25,
                   "comm_s": 0.5, "tokens": 4096, "phases": {"fwd": 0.5},
                   "groups": [{"role": "dp", "name": "dp", "group_rank": i, "group_size": 4, "calls": 3,
                               "inflight_s": 0.4}]} for i in range(4)],
        "probes": [{"ts": now, "peer": f"node-{j}", "sent": 10, "lost": j - 2, "rtt_ms": 0.05 * j} for j in (2, 3)],
        "beats": [{"run": "r1", "rank": 0, "ts": now, "state": "step", "state_s": 0.5, "step": 9}],
        "hosts": [{"ts": now, "cpu_pct": 12.5}],
        "events": [{"ts": now, "kind": "xid", "severity": "error", "message": "Xid 79", "run": "r2"},
                   {"ts": now, "kind": "kmsg", "message": "no run"}]}
    body = json.dumps(batch).encode()
    v2 = json.dumps(blocks.encode_batch(batch)).encode()
    got: dict[str, Any] = {}
    for name, parse in (("dicts", lambda: wire.parse_batch(body)), ("records", lambda: wire.parse_batch(body, keep_records=True)),
                        ("blocks", lambda: server_blocks.parse(v2))):
        cluster = m.Cluster.objects.create(name=name)
        parsed = parse()
        assert all((type(parsed[k]) is server_blocks.Block) is (name == "blocks") for k in blocks.BLOCKED)
        if name != "blocks":
            assert all((type(r) is dict) is (name == "dicts") for k in wire.KEPT_RECORDS for r in parsed[k])
        assert [o.status for o in writer.store_group([(cluster, parsed, "d")])] == ["accepted"]
        rows: dict[str, Any] = {model.__name__: [{k: v for k, v in r.items()
                                                  if k not in ("id", "cluster_id", "node_id", "run_id")}
                                                 for r in model.objects.filter(cluster=cluster).order_by(order).values()]
                                for model, order in ROWS}
        rows.update({kind.name: _framed(kind, cluster) for kind in fr.KINDS.values()})
        runs = {r.id: r.name for r in m.Run.objects.filter(cluster=cluster)}
        rows["event runs"] = [runs.get(r) for r in m.Event.objects.filter(cluster=cluster).order_by("kind")
                              .values_list("run_id", flat=True)]
        rows["runs"] = {r.name: r.last_step for r in m.Run.objects.filter(cluster=cluster)}
        rows["inventory"] = list(m.Gpu.objects.filter(node__cluster=cluster).order_by("index")
                                 .values_list("index", "uuid", "name", "pci_bus_id"))
        ids = {v: k for k, v in runs.items()}
        messages = publish._messages(0, "node-1", parsed, ids, [["node-1", 0]], set(runs))
        rows["live"] = (publish.live_part(parsed), [(g == publish.cluster_group(0), {**msg, "run": runs.get(msg.get("run"))})
                                                    for g, msg in messages])  # run ids differ: compare their names
        got[name] = rows
    assert got["records"] == got["dicts"]
    assert got["blocks"] == got["dicts"]
    want = got["dicts"]
    gpus, steps, probes = want["gpus"], want["steps"], want["probes"]
    util, remap, temp = (fr.GPUS.col(c) for c in ("util_gpu_pct", "remap_pending", "temp_c"))
    by_index = {int(g[fr.GPUS.col("index")]): g for g in gpus}
    assert len(gpus) == 4 and by_index[1][len(fr.GPUS.numbers)] == '["sw_power_cap"]' and by_index[3][remap] == 1.0
    assert by_index[2][len(fr.GPUS.numbers) + 1] == '{"pcie_gen": "not supported"}' and by_index[0][temp] is None
    assert by_index[1][util] == 41.0 and by_index[3][fr.GPUS.col("mem_used_bytes")] == 2**34 + 3
    assert want["inventory"][3] == (3, "GPU-3", "H200", "0000:03:00.0") and want["live"][0]["gpus"][1]["util_gpu_pct"] == 41.0
    by_rank = {int(s[fr.STEPS.col("rank")]): s for s in steps}
    assert [by_rank[r][fr.STEPS.col("step")] for r in range(4)] == [9, 10, 11, 12]
    assert [by_rank[r][-1] for r in range(4)] == ["r1", "r1", "r2", "r2"]
    assert json.loads(by_rank[0][len(fr.STEPS.numbers) + 2]) == [
        {"role": "dp", "name": "dp", "group_rank": 0, "group_size": 4, "index": None, "calls": 3, "bytes": None,
         "inflight_s": 0.4, "exposed_s": None, "arrive_s": None, "ops": None}]
    assert want["runs"] == {"r1": 10, "r2": 12} and want["event runs"] == [None, "r2"]  # kmsg (no run), xid
    assert sorted((json.loads(p[len(fr.PROBES.numbers)]), p[fr.PROBES.col("lost")]) for p in probes) == [
        ("node-2", 0), ("node-3", 1)]
    assert [msg["steps"] for _, msg in want["live"][1] if msg["type"] == "steps"] == [
        [[9, 0, now - 1, 1.25, None, None, 0.5, 4096], [10, 1, now - 0.9, 1.25, None, None, 0.5, 4096]],
        [[11, 2, now - 0.8, 1.25, None, None, 0.5, 4096], [12, 3, now - 0.7, 1.25, None, None, 0.5, 4096]]]
    assert want["live"][0]["beats"] == [wire.validate(wire.RankBeat, batch["beats"][0])]
