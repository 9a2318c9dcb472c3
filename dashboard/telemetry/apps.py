from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "dashboard.telemetry"
    label = "telemetry"
    verbose_name = "Clusters, nodes, runs and their time series"
