"""Shared test plumbing: which services exist, and whether their absence is a skip (a laptop) or a failure (CI)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest
from hypothesis import settings

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# No per-example time limit (hypothesis's default is 200 ms): a test checks what the code does, and speed is the
# benchmarks' (benchmarks/). On a loaded two-core machine, with the suite's two passes side by side, a numpy example
# of a few milliseconds went past it once and failed a correct test.
settings.register_profile("clusterdx", deadline=None)
settings.load_profile("clusterdx")


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


# The PostgreSQL pass once died with SIGSEGV *after* its last test had passed and the summary was printed, in the
# interpreter's teardown (daemon threads of in-process servers, C extensions: psycopg, msgspec, numpy), which turned
# a green run red. The results are decided by then; the process leaves with the session's own exit status instead of
# finalising the interpreter. Set CLUSTERDX_TEST_FINALIZE=1 to finalise normally (to chase that crash).
_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _exit_status and os.environ.get("CLUSTERDX_TEST_FINALIZE") != "1" and not hasattr(config, "workerinput"):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
