"""``clusterdx worker [--beat]``: a Celery worker on the Redis broker (production deployment)."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beat", action="store_true", help="also run the periodic scheduler (run exactly one of these)")
    p.add_argument("--concurrency", type=int, default=2)


def main(args: argparse.Namespace) -> int:
    from dashboard.cli import setup_django

    setup_django()
    from django.conf import settings

    if not settings.REDIS_URL:
        print("error: the worker needs REDIS_URL (the embedded default runs tasks inside `clusterdx server`)")
        return 2
    from dashboard.celery import app

    argv = ["worker", "--loglevel=INFO", f"--concurrency={args.concurrency}", "-Q", "clusterdx"]
    if args.beat:
        # Beat's schedule (when each task last ran) in the data directory, as the compose stack keeps it on its data
        # volume, never in whatever directory the worker was started from.
        argv += ["--beat", f"--schedule={settings.DATA_DIR / 'celerybeat-schedule'}"]
    app.worker_main(argv)
    return 0
