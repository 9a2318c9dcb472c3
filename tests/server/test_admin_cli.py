"""The administration commands, run as the real ``clusterdx`` subprocess on the test database: users, clusters,
members with roles (the last owner stays), the interconnect override, personal tokens; each change audit-logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from clusterdx.cli import build_parser
from dashboard.telemetry.models import AuditEntry, Cluster, Membership
from tests.server.test_cli import cli_db, clusterdx  # noqa: F401  (cli_db is a fixture)


def test_a_password_is_never_an_argument() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["user", "add", "ops", "--password", "hunter2hunter2"])


def test_an_operator_sets_up_a_team(cli_db: None, tmp_path: Path, settings: Any) -> None:  # noqa: F811
    secret_file = tmp_path / "pw"
    secret_file.write_text("a long enough passphrase\n")
    made = clusterdx("user", "add", "ops", "--email", "ops@example.com", "--password-file", str(secret_file))
    assert made.returncode == 0, made.stdout + made.stderr
    ops = get_user_model().objects.get(username="ops")
    assert ops.check_password("a long enough passphrase") and ops.email == "ops@example.com" and not ops.is_superuser

    assert clusterdx("cluster", "create", "gpu-farm", "--interconnect", "roce").returncode == 0
    assert clusterdx("cluster", "add-member", "gpu-farm", "ops", "--role", "owner").returncode == 0
    last = clusterdx("cluster", "remove-member", "gpu-farm", "ops")
    assert last.returncode == 1 and "the last owner of gpu-farm" in last.stdout
    assert clusterdx("cluster", "set", "gpu-farm", "--interconnect", "eth").returncode == 0
    listed = clusterdx("cluster", "list")
    assert listed.returncode == 0 and "gpu-farm" in listed.stdout and "Ethernet (set by an owner)" in listed.stdout
    assert "ops (owner)" in listed.stdout
    cluster = Cluster.objects.get(name="gpu-farm")
    assert cluster.interconnect == "eth"
    assert Membership.objects.get(cluster=cluster, user=ops).role == "owner"

    personal = clusterdx("token", "create-personal", "ops", "--name", "grafana")
    assert personal.returncode == 0, personal.stdout + personal.stderr
    token = personal.stdout.rstrip("\n").splitlines()[-1]
    answer = Client().get("/api/v1/clusters/gpu-farm/overview", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 200 and answer.json()["cluster"]["name"] == "gpu-farm"

    entries = list(AuditEntry.objects.order_by("id").values_list("action", "target"))
    assert [a for a, _ in entries] == ["user.add", "cluster.create", "member.add", "cluster.interconnect",
                                       "api_token.create"]
    assert all(name.startswith("cli:") for name in AuditEntry.objects.values_list("actor_name", flat=True))
