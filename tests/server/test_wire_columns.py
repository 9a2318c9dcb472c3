"""Nothing the wire carries is silently dropped by the server: every record field has a column or a stated
reason, and every list of a batch has a consumer."""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

import pytest

from clusterdx import wire
from dashboard.ingest import views, writer
from dashboard.live import publish
from dashboard.telemetry import models as m

TABLES = {
    wire.GpuSample: m.GpuSample, wire.HostSample: m.HostSample, wire.PortSample: m.PortSample,
    wire.Step: m.StepSample, wire.Event: m.Event, wire.Probe: m.Probe,
}


@pytest.mark.parametrize("record", list(TABLES), ids=lambda r: r.__name__)
def test_every_wire_field_has_a_column(record: type[wire.Record]) -> None:
    columns = {f.name for f in TABLES[record]._meta.get_fields()}
    stored = set(wire.field_names(record)) - writer.WIRE_NOT_COLUMNS[record]
    assert stored <= columns, f"wire fields with no column: {stored - columns}"
    assert writer.WIRE_NOT_COLUMNS[record] <= set(wire.field_names(record)), "stale exceptions"


def test_every_list_of_a_batch_is_consumed() -> None:
    consumers = inspect.getsource(views) + inspect.getsource(writer) + inspect.getsource(publish)
    for name in set(wire.field_names(wire.Batch)) - {"v"}:  # the validator consumes the version
        assert f'batch["{name}"]' in consumers or f"'{name}'" in consumers, f"nothing reads batch[{name!r}]"


ROWS = [(m.GpuSample, "gpu_index"), (m.StepSample, "rank"), (m.Probe, "peer"), (m.HostSample, "ts"), (m.Event, "kind")]


@pytest.mark.django_db
def test_the_records_ingest_keeps_are_stored_and_published_as_their_dicts_would_be() -> None:
    """The ingest path keeps a batch's GPU samples, steps and probes as the compiled decoder's records
    (wire.parse_batch's keep_records); in-process producers and the reference path hand dicts. Both must give the
    same rows, inventory and live messages."""
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
        "hosts": [{"ts": now, "cpu_pct": 12.5}],
        "events": [{"ts": now, "kind": "xid", "severity": "error", "message": "Xid 79", "run": "r2"},
                   {"ts": now, "kind": "kmsg", "message": "no run"}]}
    body = json.dumps(batch).encode()
    got: dict[str, Any] = {}
    for name, records in (("dicts", False), ("records", True)):
        cluster = m.Cluster.objects.create(name=name)
        parsed = wire.parse_batch(body, keep_records=records)
        assert all((type(r) is dict) is not records for k in wire.KEPT_RECORDS for r in parsed[k])
        assert [o.status for o in writer.store_group([(cluster, parsed, "d")])] == ["accepted"]
        rows = {model.__name__: [{k: v for k, v in r.items() if k not in ("id", "cluster_id", "node_id", "run_id")}
                                 for r in model.objects.filter(cluster=cluster).order_by(order).values()]
                for model, order in ROWS}
        runs = {r.id: r.name for r in m.Run.objects.filter(cluster=cluster)}
        rows["step runs"] = [runs[r] for r in m.StepSample.objects.filter(cluster=cluster).order_by("rank")
                             .values_list("run_id", flat=True)]
        rows["event runs"] = [runs.get(r) for r in m.Event.objects.filter(cluster=cluster).order_by("kind")
                              .values_list("run_id", flat=True)]
        rows["runs"] = {r.name: r.last_step for r in m.Run.objects.filter(cluster=cluster)}
        rows["inventory"] = list(m.Gpu.objects.filter(node__cluster=cluster).order_by("index")
                                 .values_list("index", "uuid", "name", "pci_bus_id"))
        ids = {v: k for k, v in runs.items()}
        messages = publish._messages(0, "node-1", parsed, ids, [["node-1", 0]])
        rows["live"] = (publish.live_part(parsed), [(g == publish.cluster_group(0), {**msg, "run": runs.get(msg.get("run"))})
                                                    for g, msg in messages])  # run ids differ: compare their names
        got[name] = rows
    assert got["records"] == got["dicts"]
    want = got["dicts"]
    gpus, steps, probes = want["GpuSample"], want["StepSample"], want["Probe"]
    assert len(gpus) == 4 and gpus[1]["throttle_reasons"] == ["sw_power_cap"] and gpus[3]["remap_pending"]
    assert gpus[2]["unavailable"] == {"pcie_gen": "not supported"} and gpus[0]["temp_c"] is None
    assert want["inventory"][3] == (3, "GPU-3", "H200", "0000:03:00.0") and want["live"][0]["gpus"][1]["util_gpu_pct"] == 41.0
    assert [s["step"] for s in steps] == [9, 10, 11, 12] and want["step runs"] == ["r1", "r1", "r2", "r2"]
    assert steps[0]["groups"] == [{"role": "dp", "name": "dp", "group_rank": 0, "group_size": 4, "index": None,
                                   "calls": 3, "bytes": None, "inflight_s": 0.4, "exposed_s": None, "arrive_s": None,
                                   "ops": None}]
    assert want["runs"] == {"r1": 10, "r2": 12} and want["event runs"] == [None, "r2"]  # kmsg (no run), xid
    assert [(p["peer"], p["lost"]) for p in probes] == [("node-2", 0), ("node-3", 1)]
    assert [msg["steps"] for _, msg in want["live"][1] if msg["type"] == "steps"] == [
        [[9, 0, now - 1, 1.25, None, None, 0.5, 4096], [10, 1, now - 0.9, 1.25, None, None, 0.5, 4096]],
        [[11, 2, now - 0.8, 1.25, None, None, 0.5, 4096], [12, 3, now - 0.7, 1.25, None, None, 0.5, 4096]]]
