"""The clusterdx server: a Django project split into apps that follow the data flow
(ingest -> telemetry -> live / web; diagnosis -> alerts)."""

# Load the Celery app with Django so every shared_task binds to it (and to its broker), not to Celery's default.
from dashboard.celery import app as celery_app

__all__ = ["celery_app"]
