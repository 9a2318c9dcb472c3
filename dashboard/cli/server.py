"""``clusterdx server``: the ASGI server (uvicorn). Embedded default: one worker, scheduler in-process."""

from __future__ import annotations

import argparse
import os

WEB_WORKER_ENV = "CLUSTERDX_WEB_WORKER"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=os.environ.get("CLUSTERDX_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("CLUSTERDX_PORT", "8000")))
    p.add_argument("--workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY", "1")),
                   help="ASGI worker processes (production only: the embedded default needs exactly 1)")
    p.add_argument("--no-migrate", action="store_true", help="do not apply migrations at start")


def main(args: argparse.Namespace) -> int:
    from dashboard.cli import migrate, setup_django

    setup_django()
    from django.conf import settings

    if not args.no_migrate:
        migrate()
    workers = args.workers
    if workers > 1 and not (settings.REDIS_URL and settings.DATABASE_URL):
        print("note: the embedded default keeps live state in-process; running 1 worker (set DATABASE_URL and "
              "REDIS_URL to scale out)")
        workers = 1
    if workers > 1:
        _metrics_dir()
    serve(args.host, args.port, workers)
    return 0


def _metrics_dir() -> None:
    """N workers share one port, so a scrape of /metrics lands on any one of them: give them prometheus_client's
    multiprocess mode (a fresh, empty directory of per-process files that every worker sums) unless the operator
    set PROMETHEUS_MULTIPROC_DIR already. Under /tmp: a tmpfs in the compose and k8s stacks, PrivateTmp under systemd;
    the workers are spawned after this, so they inherit it."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="clusterdx-metrics-")


def serve(host: str, port: int, workers: int = 1) -> None:
    import uvicorn

    # Each worker (uvicorn spawns them with this environment) claims a CPU at its lifespan's start
    # (dashboard.affinity); an app served by anything else (the tests' servers in threads, the demo) is left alone.
    os.environ[WEB_WORKER_ENV] = "1"

    uvicorn.run("dashboard.asgi:application", host=host, port=port, workers=workers, lifespan="on",
                log_level=os.environ.get("UVICORN_LOG_LEVEL", "warning"), proxy_headers=True, ws="websockets-sansio")
