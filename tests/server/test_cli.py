"""The command line: `clusterdx token create` prints the token alone on its last line, and it works for ingest."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dashboard.telemetry.models import Cluster, IngestToken
from tests.server.conftest import make_batch, post

ROOT = Path(__file__).resolve().parents[2]


def clusterdx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterdx", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "DJANGO_SETTINGS_MODULE": "dashboard.settings"})


@pytest.fixture
def cli_db(transactional_db: None, settings: Any) -> None:
    """The subprocess must use the test database: point it at the same one this test process uses."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    if connection.vendor == "sqlite":
        os.environ["CLUSTERDX_SQLITE_PATH"] = name
    else:
        url = os.environ["DATABASE_URL"]
        os.environ["DATABASE_URL"] = url.rsplit("/", 1)[0] + "/" + name
    yield
    os.environ.pop("CLUSTERDX_SQLITE_PATH", None)
    if connection.vendor != "sqlite":
        os.environ["DATABASE_URL"] = url


def test_token_create_prints_the_secret_alone_on_the_last_line(cli_db: None, client: Any, monkeypatch: Any) -> None:
    from dashboard.telemetry import tokens

    monkeypatch.setattr(tokens, "CACHE_TTL_S", 0.2)
    out = clusterdx("token", "create", "gpu-farm", "--name", "agents")
    assert out.returncode == 0, out.stderr
    token = out.stdout.rstrip("\n").splitlines()[-1]
    assert token.startswith("cdx_") and " " not in token
    cluster = Cluster.objects.get(name="gpu-farm")
    row = IngestToken.objects.get(cluster=cluster)
    assert token not in row.digest and row.digest != token, "only a hash is stored"
    assert row.last_used_at is None
    assert post(client, make_batch(), token).json()["status"] == "accepted"
    row.refresh_from_db()
    assert row.last_used_at is not None

    listed = clusterdx("token", "list", "gpu-farm")
    assert row.prefix in listed.stdout and token not in listed.stdout
    assert clusterdx("token", "revoke", row.prefix).returncode == 0
    time.sleep(0.3)  # another process revoked it: this one stops accepting it within the cache TTL
    assert post(client, make_batch(seq=1), token).status_code == 401


def test_token_create_refuses_a_bad_cluster_name(cli_db: None) -> None:
    out = clusterdx("token", "create", "bad name; drop table")
    assert out.returncode == 2 and "must be letters" in out.stdout
    assert not Cluster.objects.exists()


def test_the_command_lists_its_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "clusterdx", "--help"], capture_output=True, text=True, cwd=ROOT)
    for name in ("demo", "server", "token", "agent", "simulate", "doctor"):
        assert name in out.stdout, name


def test_worker_beat_keeps_its_schedule_in_the_data_directory(settings: Any, monkeypatch: Any) -> None:
    """`clusterdx worker --beat` started from any directory (the ingest benchmark starts one from the checkout)
    writes beat's schedule into CLUSTERDX_DATA_DIR, as the compose stack keeps it on its data volume: it once
    left celerybeat-schedule.* in the checkout, where they were committed."""
    import argparse

    from dashboard.celery import app
    from dashboard.cli import worker

    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    argv: list[list[str]] = []
    monkeypatch.setattr(app, "worker_main", argv.append)  # the argv Celery would start with, not a worker
    parser = argparse.ArgumentParser()
    worker.configure(parser)
    assert worker.main(parser.parse_args(["--beat"])) == 0
    assert f"--schedule={settings.DATA_DIR / 'celerybeat-schedule'}" in argv[0] and "--beat" in argv[0]
    # Threads of one process by default: a worker is one owner of the diagnosis windows it holds.
    assert {"--pool=threads", "--concurrency=2"} <= set(argv[0])
    worker.main(parser.parse_args(["--concurrency", "4", "--pool", "prefork"]))
    assert not any(a.startswith(("--beat", "--schedule")) for a in argv[1])
    assert {"--pool=prefork", "--concurrency=4"} <= set(argv[1])
