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


@pytest.mark.django_db
def test_the_gpu_records_ingest_keeps_are_stored_and_published_as_their_dicts_would_be() -> None:
    """The ingest path keeps a batch's GPU samples as the compiled decoder's records (wire.parse_batch's
    gpu_records); in-process producers and the reference path hand dicts. Both must give the same rows."""
    now = time.time()
    batch = {"v": 1, "agent_id": "a", "seq": 0, "host": "node-1", "sent_at": now, "gpus": [
        {"ts": now, "index": i, "uuid": f"GPU-{i}", "name": "H200", "pci_bus_id": f"0000:{i:02x}:00.0",
         "util_gpu_pct": 40.0 + i, "mem_used_bytes": 2**34 + i, "temp_c": None, "power_w": 500.5,
         "throttle_reasons": ["sw_power_cap"] if i else [], "ecc_dbe_volatile": i, "remap_pending": bool(i),
         "nvlink_links_up": 18, "unavailable": {"pcie_gen": "not supported"} if i == 2 else None} for i in range(4)]}
    body = json.dumps(batch).encode()
    got: dict[str, Any] = {}
    for name, records in (("dicts", False), ("records", True)):
        cluster = m.Cluster.objects.create(name=name)
        parsed = wire.parse_batch(body, gpu_records=records)
        assert (type(parsed["gpus"][0]) is dict) is not records
        assert [o.status for o in writer.store_group([(cluster, parsed, "d")])] == ["accepted"]
        rows = m.GpuSample.objects.filter(cluster=cluster).order_by("gpu_index").values()
        got[name] = ([{k: v for k, v in r.items() if k not in ("id", "cluster_id", "node_id")} for r in rows],
                     list(m.Gpu.objects.filter(node__cluster=cluster).order_by("index")
                          .values_list("index", "uuid", "name", "pci_bus_id")),
                     publish.live_part(parsed)["gpus"])
    assert got["records"] == got["dicts"]
    samples, inventory, live = got["dicts"]
    assert len(samples) == 4 and samples[1]["throttle_reasons"] == ["sw_power_cap"] and samples[3]["remap_pending"]
    assert samples[2]["unavailable"] == {"pcie_gen": "not supported"} and samples[0]["temp_c"] is None
    assert inventory[3] == (3, "GPU-3", "H200", "0000:03:00.0") and live[1]["util_gpu_pct"] == 41.0
