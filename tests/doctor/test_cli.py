"""`clusterdx doctor` end to end through the real command table."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from clusterdx.cli import main

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def test_it_prints_json_for_several_files(capsys):
    rc = main(["doctor", "--json", str(LOGS / "nccl_ib_error4_h100.log"), str(LOGS / "nccl_ib_status12_plugin.log")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["kind"] == "nccl" and len(out["facts"]["hosts"]) == 4


def test_it_prints_a_human_report_with_a_next_step(capsys):
    assert main(["doctor", str(LOGS / "xid_79_journalctl_open_gpu_1151.log")]) == 0
    text = capsys.readouterr().out
    assert "verdict: Xid 79" in text and "next:" in text


def test_dash_reads_standard_input(capsys, monkeypatch):
    data = (LOGS / "torch_watchdog_timeout_1x.log").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["doctor", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["facts"]["error_class"] == "timeout"


def test_kind_overrides_detection(capsys):
    assert main(["doctor", "--json", "--kind", "xid", str(LOGS / "nccl_ib_error4_h100.log")]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "xid"


def test_usage_errors_exit_2(capsys, tmp_path):
    assert main(["doctor", str(tmp_path / "missing.log")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--kind", "bogus", str(LOGS / "nccl_ib_error4_h100.log")])
    assert exc.value.code == 2
