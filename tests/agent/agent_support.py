"""Helpers for the agent tests: the stand-in NVML, a real HTTP receiver, and the agent as a subprocess."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from clusterdx import blocks, wire
from tests.conftest import reply_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOKEN = "test-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_standin(out_dir: Path, *defines: str) -> Path:
    """Compile the stand-in NVML as ``out_dir/libnvidia-ml.so.1``; returns the directory for LD_LIBRARY_PATH."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    cmd = ["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-soname,libnvidia-ml.so.1", *[f"-D{d}" for d in defines],
           "-o", str(lib), str(HERE / "standin_nvml.c")]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no C compiler (cc) to build the stand-in NVML")
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the stand-in NVML does not compile:\n{exc.stderr}")
    return out_dir


# -------------------------------------------------------------------------------------------------------------
# A real ingest receiver: the wire contract's answers, with a hook to script failures.

Respond = Callable[[dict[str, Any]], tuple[int, dict[str, Any]] | None]


class Receiver:
    def __init__(self, port: int = 0, respond: Respond | None = None) -> None:
        self.accepted: list[dict[str, Any]] = []  # validated batches, in arrival order, first delivery only
        self.posts: list[int] = []  # the seq of every POST, refused or not
        self.duplicates: list[int] = []
        self.respond = respond
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real server offers

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, answer = receiver.handle(self.path, dict(self.headers), body)
                reply_json(self, status, answer)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def handle(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        if path != "/api/v1/ingest":
            return 404, {"error": "not_found", "detail": path}
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {"error": "unauthorized", "detail": "unknown token"}
        if headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            payload = json.loads(body)
            if payload.get("v") == blocks.BLOCK_WIRE_VERSION:  # the agent's default: blocks, read back as records
                payload = blocks.decode_batch(payload)
            batch = wire.validate_batch(payload)
        except ValueError as exc:
            return 400, {"error": "invalid", "detail": str(exc)}
        with self._lock:
            self.posts.append(batch["seq"])
            scripted = self.respond(batch) if self.respond else None
            if scripted is not None:
                return scripted
            key = (batch["agent_id"], batch["seq"])
            if key in self._seen:
                self.duplicates.append(batch["seq"])
                return 200, {"status": "duplicate", "seq": batch["seq"]}
            self._seen.add(key)
            self.accepted.append(batch)
        return 200, {"status": "accepted", "seq": batch["seq"]}

    def seqs(self) -> list[int]:
        with self._lock:
            return [b["seq"] for b in self.accepted]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -------------------------------------------------------------------------------------------------------------
# The agent as a subprocess, as it runs on a node.

# Only the sources this suite is about; the others have their own tests and would make runs machine-dependent.
OTHER_SOURCES = ("host", "ib", "kmsg", "nccl", "probes")


class AgentProcess:
    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, spool: Path, hook_port: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.spool = spool
        self.hook_port = hook_port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def spooled_seqs(self) -> list[int]:
        if not self.spool.exists():
            return []
        db = sqlite3.connect(f"file:{self.spool}?mode=ro", uri=True)
        try:
            return [row[0] for row in db.execute("SELECT seq FROM batch ORDER BY seq")]
        except sqlite3.OperationalError:  # the agent has not created its tables yet
            return []
        finally:
            db.close()


def start_agent(tmp_path: Path, server: str, *, lib_dir: Path | None, scenario: str = "", interval: float = 0.2,
                toml: str = "", args: tuple[str, ...] = (), spool: Path | None = None, name: str = "agent",
                hook_port: int | None = None, token: str = TOKEN, backoff_max: float = 0.3) -> AgentProcess:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    spool = spool or tmp_path / f"{name}-spool.sqlite3"
    hook_port = hook_port or free_port()
    config = tmp_path / f"{name}.toml"
    disabled = "".join(f"[sources.{s}]\nenabled = false\n" for s in OTHER_SOURCES)
    config.write_text(
        f'agent_id = "test-node"\nhost = "test-node"\ninterval_s = {interval}\nspool_path = "{spool}"\n'
        f"backoff_initial_s = 0.05\nbackoff_max_s = {backoff_max}\nhttp_timeout_s = 2\n{toml}\n"
        f"{disabled}[sources.gpu]\nslow_interval_s = 0.2\n[sources.hooks]\naddr = \"127.0.0.1:{hook_port}\"\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["LD_LIBRARY_PATH"] = str(lib_dir) if lib_dir else str(tmp_path / "no-nvml-here")
    if scenario:
        path = tmp_path / f"{name}-scenario.txt"
        path.write_text(scenario)
        env["CLUSTERDX_STANDIN_NVML"] = str(path)
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clusterdx", "agent", "--server", server, "--token-file", str(token_file),
             "--config", str(config), *args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    return AgentProcess(proc, log_path, spool, hook_port)
