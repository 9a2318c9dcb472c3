"""Each kind of time-series sample is read through one storage module (dashboard/storage/), so the samples' storage
can change there without a page, an API or the evidence noticing (it did: rows became frames, docs/scaling.md, the
columnar plan). An import scan of dashboard/ fails when any other module names the model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Beside each model's reading module, who may still name it: its definition, the frames' codec, the writer, the
# retention task, and the diagnosis pass's held window (it reads the frames' columns through the codec).
KEEPERS = {"dashboard/telemetry/models.py", "dashboard/storage/frames.py", "dashboard/ingest/writer.py",
           "dashboard/diagnosis/loader.py", "dashboard/telemetry/tasks.py"}
READERS = {
    "GpuFrame": {"dashboard/storage/gpu_samples.py", "dashboard/storage/models.py", "dashboard/storage/rollup.py"},
    "StepFrame": {"dashboard/storage/step_samples.py", "dashboard/storage/steps.py"},
    "ProbeFrame": {"dashboard/storage/probe_samples.py", "dashboard/storage/probe_index.py"},
    "ProbeInbound": {"dashboard/storage/probe_samples.py", "dashboard/storage/probe_index.py"},
}


def names_the_model(source: str, model: str) -> list[int]:
    """Lines where ``source`` imports ``model`` from dashboard.telemetry.models, or reads it off that module imported
    under any name (``from dashboard.telemetry import models as m`` ... ``m.GpuFrame``). A class of the same name
    elsewhere (the wire's ``wire.GpuSample``, a msgspec struct) is another thing."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dashboard.telemetry.models":
            lines += [node.lineno for a in node.names if a.name == model]
        elif isinstance(node, ast.ImportFrom) and node.module == "dashboard.telemetry":
            aliases.update(a.asname or a.name for a in node.names if a.name == "models")
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "dashboard.telemetry.models" and a.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == model and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_each_way_of_naming_the_model() -> None:
    assert names_the_model("from dashboard.telemetry.models import Node, GpuFrame\n", "GpuFrame") == [1]
    assert names_the_model("from dashboard.telemetry import models as m\nq = m.GpuFrame.objects\n", "GpuFrame") == [2]
    assert names_the_model("import dashboard.telemetry.models as tm\ntm.StepFrame\n", "StepFrame") == [2]
    assert names_the_model("from clusterdx import wire\nwire.GpuFrame\n", "GpuFrame") == []
    assert names_the_model("from dashboard.telemetry.models import GpuFrame\n", "StepFrame") == []


@pytest.mark.parametrize("model", sorted(READERS))
def test_only_its_storage_module_reads_a_kind_of_sample(model: str) -> None:
    allowed = KEEPERS | READERS[model]
    offenders = []
    for path in sorted((ROOT / "dashboard").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "/migrations/" in rel or rel in allowed:
            continue
        offenders += [f"{rel}:{line}" for line in names_the_model(path.read_text(), model)]
    reader = sorted(r for r in READERS[model] if r.endswith("_samples.py"))[0]
    assert not offenders, f"read {model} through {reader}: {offenders}"
