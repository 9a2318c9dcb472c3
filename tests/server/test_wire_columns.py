"""Nothing the wire carries is silently dropped by the server: every record field has a column or a stated
reason, and every list of a batch has a consumer."""

from __future__ import annotations

import inspect

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
