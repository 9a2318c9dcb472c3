from django.urls import path

from dashboard import metrics
from dashboard.ingest.views import ingest

urlpatterns = [
    path("api/v1/ingest", ingest, name="ingest"),
    path("metrics", metrics.view, name="metrics"),
]
