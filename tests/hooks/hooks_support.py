"""Real receivers for the hooks' two transports: a UDP socket standing in for the node agent, and an HTTP server
standing in for the ingest endpoint. Both validate every payload with clusterdx.wire, so a test that gets records
has also proven they are valid."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from clusterdx import wire
from tests.conftest import reply_json


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class UdpAgent:
    """Receives HookDatagrams on 127.0.0.1; keeps the validated ones and any validation error."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # as a real agent would
        self.sock.bind(("127.0.0.1", port))
        self.sock.settimeout(0.05)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.datagrams: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(70_000)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                assert len(data) <= wire.MAX_DATAGRAM_BYTES, len(data)
                self.datagrams.append(wire.validate(wire.HookDatagram, json.loads(data)))
            except (ValueError, AssertionError) as exc:
                self.errors.append(repr(exc))

    def records(self, kind: str) -> list[dict[str, Any]]:
        return [r for d in list(self.datagrams) for r in d[kind]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)
        self.sock.close()


class IngestServer:
    """POST /api/v1/ingest. Answers with the next status in ``statuses`` (then 200), records what it got."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []  # every request, accepted or not: headers and seq
        self.errors: list[str] = []
        self.statuses: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                status = outer.statuses.pop(0) if outer.statuses else 200
                try:
                    assert self.path == "/api/v1/ingest", self.path
                    batch = wire.validate_batch(json.loads(body))
                except (ValueError, AssertionError) as exc:
                    outer.errors.append(repr(exc))
                    status, batch = 400, None
                outer.requests.append({"auth": self.headers.get("Authorization"), "status": status,
                                       "seq": batch and batch["seq"], "agent_id": batch and batch["agent_id"]})
                if status == 200 and batch is not None:
                    outer.batches.append(batch)
                answer = {"status": "accepted", "seq": batch and batch["seq"]} if status == 200 else \
                    {"error": "nope", "detail": f"test server answered {status}"}
                reply_json(self, status, answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def records(self, kind: str) -> list[dict[str, Any]]:
        return [r for b in list(self.batches) for r in b[kind]]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port nothing listens on (bound then released: good enough on a test machine)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """One rank of a gloo job on loopback, as torchrun starts it: one thread (two cores), the repository importable,
    and no CLUSTERDX_SERVER from the test's own environment unless ``extra`` sets it."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("CLUSTERDX_SERVER", None)
    return {**env, **extra}


def run_ranks(jobs: list[tuple[list[str], dict[str, str]]], timeout: float, tail: int | None = None) -> list[str]:
    """Start every (argv, env) at once, wait for all (killing what is left at the end), and require each to exit 0;
    returns their outputs (stdout and stderr). ``tail``: characters of each output the failure message keeps."""
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for args, env in jobs]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-tail:] if tail else o for o in outputs)
    return outputs
