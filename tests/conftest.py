"""Shared test plumbing: which services exist, and whether their absence is a skip (a laptop) or a failure (CI)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def service_missing(reason: str) -> None:
    """Skip with ``reason`` on a developer machine; fail under CI, where every service must be there."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: a missing service is a failure)")
    pytest.skip(reason)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reply_json(handler: Any, status: int, answer: dict[str, Any]) -> None:
    """Answer a stdlib ``BaseHTTPRequestHandler`` request with JSON (the stand-in receivers of several suites)."""
    data = json.dumps(answer).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
