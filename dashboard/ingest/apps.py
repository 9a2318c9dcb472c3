from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "dashboard.ingest"
    label = "ingest"
