"""The spool writes wire version 2 when told to (agent.toml ``wire_version = 2``), and falls back to version 1 for a
batch a block cannot carry exactly, counted and logged: such a batch is never dropped or rounded."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from collectors.agent.spool import Spool

BATCH = {"v": 1, "agent_id": "a", "host": "node-1", "sent_at": 1.7e9,
         "gpus": [{"ts": 1.7e9, "index": 0, "util_gpu_pct": 40.0}],
         "steps": [{"run": "r", "rank": 0, "step": 9, "ts": 1.7e9, "step_time_s": 1.0, "tokens": 4096}]}


def _body(spool: Spool) -> dict:
    got = spool.oldest()
    assert got is not None
    return json.loads(gzip.decompress(got.body))


def test_a_version_2_spool_sends_blocks_and_renumbers_them(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.sqlite3", wire_version=2)
    seq = spool.put(BATCH)
    body = _body(spool)
    assert next(iter(body)) == "v" and body["v"] == 2 and body["seq"] == seq
    assert body["gpus"]["n"] == 1 and body["steps"]["cols"]["run"] == ["r"] and body["probes"]["n"] == 0
    new = spool.renumber(seq)
    assert new is not None and _body(spool)["seq"] == new and _body(spool)["v"] == 2


def test_what_no_block_carries_goes_as_version_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = Spool(tmp_path / "s.sqlite3", wire_version=2)
    huge = {**BATCH, "steps": [{**BATCH["steps"][0], "tokens": 2**60}]}
    with caplog.at_level(logging.WARNING):
        spool.put(huge)
    body = _body(spool)
    assert body["v"] == 1 and body["steps"][0]["tokens"] == 2**60
    assert spool.as_version_1 == 1 and "sent as wire version 1" in caplog.text


def test_version_1_stays_the_default(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.sqlite3")
    spool.put(BATCH)
    assert _body(spool)["gpus"] == BATCH["gpus"]
