"""``clusterdx worker [--beat]``: a Celery worker on the Redis broker (production deployment).

Its tasks run in threads of one process, not in forked children: the diagnosis pass keeps its window in the process
that ran it (:mod:`dashboard.diagnosis.held`) and a cluster belongs to that process (:func:`dashboard.diagnosis.tasks
.due`), so a worker of N threads is one owner with one window, where N children were N windows, each read afresh
when a tick came its way. Most other tasks wait on the network or the database (alert deliveries, retention,
rollups), which threads do as well as processes; the two that compute (the probe index, the efficiency figures) let
a pass go first (:mod:`dashboard.turns`): threads of one process share one GIL, and a pass beside one took twice as
long. One process's CPU bounds a worker's passes, and more clusters take more workers.
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beat", action="store_true", help="also run the periodic scheduler (run exactly one of these)")
    p.add_argument("--concurrency", type=int, default=2, help="tasks at a time (threads of this process)")
    p.add_argument("--pool", choices=["threads", "prefork"], default="threads",
                   help="prefork: a child process per task slot (each with a diagnosis window of its own)")


def main(args: argparse.Namespace) -> int:
    from dashboard.cli import setup_django

    setup_django()
    from django.conf import settings

    if not settings.REDIS_URL:
        print("error: the worker needs REDIS_URL (the embedded default runs tasks inside `clusterdx server`)")
        return 2
    from dashboard.celery import app

    argv = ["worker", "--loglevel=INFO", f"--concurrency={args.concurrency}", f"--pool={args.pool}",
            "-Q", "clusterdx"]
    if args.beat:
        # Beat's schedule (when each task last ran) in the data directory, as the compose stack keeps it on its data
        # volume, never in whatever directory the worker was started from.
        argv += ["--beat", f"--schedule={settings.DATA_DIR / 'celerybeat-schedule'}"]
    app.worker_main(argv)
    return 0
