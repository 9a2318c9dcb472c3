from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "dashboard.telemetry"
    label = "telemetry"
    verbose_name = "Clusters, nodes, runs and their time series"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from dashboard.telemetry.models import Node
        from dashboard.telemetry.placement import place_new_node

        # A node an uploaded topology file named before its agent first reported (see placement.py).
        post_save.connect(place_new_node, sender=Node, dispatch_uid="telemetry.place_new_node")
