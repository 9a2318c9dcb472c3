"""Guards in front of the views: a request body limit at the ASGI level, the Content-Security-Policy header, and a
failed sign-in limiter.

* :class:`BodyLimit` wraps the Django ASGI app. Django's ASGI handler reads the whole body (to a temporary file past
  2.5 MB) before it routes or authenticates anything, so a multi-GB POST to ``/login/`` would be spooled to disk. The
  limit is checked on ``Content-Length`` before a byte is read, and counted for chunked bodies, which are cut off at
  the limit. Either way the answer is 413 and the connection is closed.
* :class:`ContentSecurityPolicy` sends a nonce-free policy: the pages load only our own scripts (ES modules and
  plotly.js from ``/static/``), embed data as non-executed JSON blocks, and have no inline handlers.
* :class:`LoginThrottle` counts failed sign-ins per user name and client address in Django's cache (process memory
  embedded, Redis with ``REDIS_URL``) and answers 429 once the limit is reached, without checking the password.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


# --- body limit --------------------------------------------------------------------------------------------------
def body_limit(path: str) -> int:
    """Bytes a request body to ``path`` may have: the log doctor takes file uploads, everything else small forms."""
    conf = settings.CLUSTERDX
    if path == "/api/v1/ingest":
        return int(conf["INGEST_MAX_BODY_BYTES"])
    if path == "/doctor/":
        return int(conf["DOCTOR_MAX_BODY_BYTES"])
    return int(conf["MAX_BODY_BYTES"])


async def _refuse_too_large(send: Send, limit: int) -> None:
    body = f"request body over {limit} bytes\n".encode()
    # "connection: close": the server drops the connection instead of draining the rest of the body.
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for a body over :func:`body_limit`, decided before the app reads it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["path"])
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await _refuse_too_large(send, limit)
            return
        await _Counted(self.app, limit, receive, send).run(scope)


class _Counted:
    """One request whose body is counted as it streams in (chunked, or a Content-Length that lied)."""

    def __init__(self, app: ASGIApp, limit: int, receive: Receive, send: Send) -> None:
        self.app, self.limit, self._receive, self._send = app, limit, receive, send
        self.size = 0
        self.started = False  # the app began its answer
        self.cut = False  # we answered 413: the app gets a disconnect and its own answer is dropped

    async def run(self, scope: dict[str, Any]) -> None:
        await self.app(scope, self.receive, self.send)

    async def receive(self) -> dict[str, Any]:
        if self.cut:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                self.cut = True
                if not self.started:
                    await _refuse_too_large(self._send, self.limit)
                return {"type": "http.disconnect"}  # Django stops reading (RequestAborted) and answers nothing
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if self.cut:
            return
        self.started = True
        await self._send(message)


# --- Content-Security-Policy ------------------------------------------------------------------------------------
# No 'unsafe-inline' for scripts: every script is a file under /static/; the JSON blocks (type=application/json) are
# data and not subject to script-src. Styles allow inline: plotly positions its SVG with style attributes and the
# pages set a few (legend swatches) from data; a style cannot run code. img data:/blob: for plotly's images.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "font-src 'self' data:; connect-src 'self' {ws}; worker-src 'self' blob:; object-src 'none'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def content_security_policy(request: HttpRequest) -> str:
    # 'self' covers ws:/wss: to the same host in CSP 3, but not in every browser: name the page's own socket origin.
    scheme = "wss" if request.is_secure() else "ws"
    return _CSP.format(ws=f"{scheme}://{request.get_host()}")


class ContentSecurityPolicy:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = content_security_policy(request)
        return response


# --- failed sign-ins ------------------------------------------------------------------------------------------------
def _key(username: str, ip: str) -> str:
    # Hashed: a user name is arbitrary text and cache keys must be short and plain.
    return "login-failures:" + hashlib.sha256(f"{username.strip().lower()}\0{ip}".encode()).hexdigest()[:32]


def login_failures(username: str, ip: str) -> int:
    return int(cache.get(_key(username, ip), 0))


def count_login_failure(username: str, ip: str) -> None:
    key, window = _key(username, ip), int(settings.CLUSTERDX["LOGIN_FAILURE_WINDOW_S"])
    cache.add(key, 0, timeout=window)  # the window starts at the first failure; incr keeps its expiry
    try:
        cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.set(key, 1, timeout=window)


def reset_login_failures(username: str, ip: str) -> None:
    cache.delete(_key(username, ip))


class LoginThrottle:
    """At most ``LOGIN_MAX_FAILURES`` failed sign-ins per user name and address per ``LOGIN_FAILURE_WINDOW_S``.

    Keyed on both so an attacker cannot lock a user out from everywhere, nor spread guesses over many names from one
    address without each name's own count growing. Behind a proxy the address is the one uvicorn takes from
    X-Forwarded-For (``--forwarded-allow-ips``)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.path = settings.LOGIN_URL if settings.LOGIN_URL.startswith("/") else None

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method != "POST" or request.path != self._login_path():
            return self.get_response(request)
        username, ip = request.POST.get("username", ""), request.META.get("REMOTE_ADDR", "")
        conf = settings.CLUSTERDX
        if login_failures(username, ip) >= int(conf["LOGIN_MAX_FAILURES"]):
            minutes = max(1, int(conf["LOGIN_FAILURE_WINDOW_S"]) // 60)
            response = HttpResponse(f"Too many failed sign-ins for this user from your address. Try again in "
                                    f"{minutes} minutes.\n", status=429, content_type="text/plain; charset=utf-8")
            response["Retry-After"] = str(int(conf["LOGIN_FAILURE_WINDOW_S"]))
            return response
        response = self.get_response(request)
        # LoginView redirects on success and shows the form again (200) on a wrong password.
        if response.status_code == 200:
            count_login_failure(username, ip)
        elif response.status_code == 302:
            reset_login_failures(username, ip)
        return response

    def _login_path(self) -> str:
        if self.path is None:
            from django.urls import reverse

            self.path = reverse(settings.LOGIN_URL)
        return self.path
