"""The hooks never carry their bearer token across a redirect: a server (or anything in between) that answers 3xx
gets the batch refused for good, and the redirect's target never sees the token or the batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hooks_support import wait_for

from trainer_hooks import Monitor


class Recorder:
    """A stdlib HTTP server that answers every request with ``status`` (and ``Location`` when set)."""

    def __init__(self, status: int, location: str = "") -> None:
        self.seen: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                outer.seen.append({"method": self.command, "path": self.path, "body": len(self.rfile.read(length)),
                                   "auth": self.headers.get("Authorization")})
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def elsewhere() -> Iterator[Recorder]:
    server = Recorder(200)
    yield server
    server.close()


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_token_never_follows_it(code: int, elsewhere: Recorder, hook_env: Any,
                                                              caplog: Any) -> None:
    redirector = Recorder(code, f"{elsewhere.url}/steal")
    try:
        hook_env.setenv("CLUSTERDX_SERVER", redirector.url)
        hook_env.setenv("CLUSTERDX_TOKEN", "cdx_secret_token")
        mon = Monitor(run="redirected", transport="server", interval=30)
        with mon.step(tokens=1):
            pass
        mon.close()
        assert wait_for(lambda: len(redirector.seen) >= 1, timeout=5)
        assert elsewhere.seen == [], "the redirect target got a request (with the token)"
        assert len(redirector.seen) == 1, "a redirect is permanent: no retry"
        assert mon.stats()["dropped"] == {"server_rejected": 3}  # meta, the step, "finished"
        assert f"HTTP {code}" in caplog.text and f"{elsewhere.url}/steal" in caplog.text
        assert "CLUSTERDX_SERVER" in caplog.text
    finally:
        redirector.close()
