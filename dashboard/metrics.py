"""The server's own health for Prometheus: ``GET /metrics`` (text exposition format, prometheus_client).

Several processes serve one deployment (N web workers behind one port, Celery workers running the diagnosis and the
alert deliveries). A scrape lands on one web worker, so per-process registries would show a different worker's
numbers each time. When ``PROMETHEUS_MULTIPROC_DIR`` is set (it must be, before start, in every process, to one
directory that is emptied when the deployment starts; ``clusterdx server --workers N`` sets a fresh one for its
workers when it is not set) prometheus_client's multiprocess mode sums the processes'
files into one view; without it (the embedded server: one process, Celery tasks in-process) the default registry
is that view already.

Access: with ``CLUSTERDX_METRICS_TOKEN`` set, a scraper sends ``Authorization: Bearer <token>``; without it only
loopback clients and signed-in staff read it. Labels carry codes and statuses only, never cluster or host names.
"""

from __future__ import annotations

import hmac
import os

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

INGEST_ACCEPTED = Counter("clusterdx_ingest_accepted_batches", "Batches answered 200, by status (accepted, duplicate)",
                          ["status"])
INGEST_REFUSED = Counter("clusterdx_ingest_refused_batches",
                         "Batches refused, by error code (busy, unavailable, invalid_batch, ...)", ["reason"])
# Which agents speak wire version 2 yet (a rollout's progress): valid posts by version, before storage.
INGEST_WIRE = Counter("clusterdx_ingest_posts_by_wire_version", "Valid posts, by wire version (1 records, 2 blocks)",
                      ["version"])
QUEUE_DEPTH = Gauge("clusterdx_ingest_queue_batches", "Batches waiting for the group commit",
                    multiprocess_mode="livesum")
COMMIT_SECONDS = Histogram("clusterdx_ingest_commit_seconds", "Time to store and commit one group of batches",
                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
GROUP_BATCHES = Histogram("clusterdx_ingest_batches_per_commit", "Batches stored by one commit",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
DIAGNOSIS_SECONDS = Histogram("clusterdx_diagnosis_pass_seconds", "Duration of one diagnosis pass over a cluster",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
# Where a pass's time goes, summed (a part's mean is its sum over the passes' count): reading the window, the
# detectors, the findings' reconcile, and the embedded pass's trip to its process and back (the beats pickled, the
# detections returned; the server's own threads are busy with ingest meanwhile).
DIAGNOSIS_PART_SECONDS = Counter("clusterdx_diagnosis_pass_part_seconds", "Seconds of diagnosis passes, by part",
                                 ["part"])
WRITE_TURN_SECONDS = Histogram("clusterdx_db_write_wait_seconds",
                               "Time a write transaction waited for its turn (the embedded SQLite backend's queue)",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
BACKGROUND_YIELD_SECONDS = Counter("clusterdx_background_yield_seconds",
                                   "Seconds background tasks (probe index, efficiency) waited for a diagnosis pass in "
                                   "their process (dashboard.turns)")
ALERT_DELIVERIES = Counter("clusterdx_alert_deliveries", "Alert delivery attempts, by outcome", ["status"])


def _registry() -> CollectorRegistry | None:
    if not MULTIPROCESS:
        return None  # the default registry
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def _allowed(request: HttpRequest) -> bool:
    token = settings.CLUSTERDX["METRICS_TOKEN"]
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return True
    if token:
        sent = request.headers.get("Authorization", "")
        return sent.startswith("Bearer ") and hmac.compare_digest(sent[len("Bearer "):].strip().encode(), token.encode())
    return request.META.get("REMOTE_ADDR", "") in ("127.0.0.1", "::1")


def view(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        detail = ("send 'Authorization: Bearer <CLUSTERDX_METRICS_TOKEN>'" if settings.CLUSTERDX["METRICS_TOKEN"]
                  else "only loopback clients and staff; set CLUSTERDX_METRICS_TOKEN to let a scraper in")
        return JsonResponse({"error": "forbidden", "detail": detail}, status=403)
    registry = _registry()
    data = generate_latest(registry) if registry is not None else generate_latest()
    return HttpResponse(data, content_type=CONTENT_TYPE_LATEST)
