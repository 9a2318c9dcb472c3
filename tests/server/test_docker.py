"""No Docker engine runs here, so check what can be checked: the compose file parses, and every command and variable
in it is one the code actually has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from clusterdx.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def read_by_code() -> set[str]:
    """Environment variables the server reads (settings use env_* helpers; *_FILE variants come with env_str)."""
    names: set[str] = set()
    for path in (ROOT / "dashboard").rglob("*.py"):
        for name in re.findall(r"env_(?:str|bool|int|float|list)\(\s*\"([A-Z0-9_]+)\"", path.read_text()):
            names |= {name, f"{name}_FILE"}
    return names


def test_the_stack_has_every_service(compose: dict) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "web", "worker", "beat"}
    for name in ("web", "worker", "beat"):
        assert compose["services"][name]["image"] == "clusterdx/server:latest"


def test_every_variable_is_one_the_settings_read(compose: dict) -> None:
    known = read_by_code()
    for name in ("web", "worker", "beat"):
        env = compose["services"][name]["environment"]
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables nothing reads: {unknown}"
        assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY_FILE"} <= set(env)


def test_every_command_exists(compose: dict) -> None:
    parser = build_parser()
    for name in ("web", "worker"):
        command = compose["services"][name]["command"]
        assert command[0] == "clusterdx"
        args = parser.parse_args(command[1:])
        assert isinstance(args, argparse.Namespace) and callable(args._main)
    beat = compose["services"]["beat"]["command"]
    assert beat[:3] == ["celery", "-A", "dashboard.celery"]
    from dashboard.celery import app

    assert app.conf.beat_schedule, "beat has something to schedule"


def test_the_dockerfile_copies_every_package() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for package in ("clusterdx", "dashboard", "collectors", "trainer_hooks"):
        assert f"COPY {package} ./{package}" in text
        assert (ROOT / package).is_dir()
    cmd = re.search(r'CMD \[(.*)\]', text).group(1)
    assert build_parser().parse_args([a.strip(' "') for a in cmd.split(",")][1:])
