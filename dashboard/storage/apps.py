from django.apps import AppConfig


class StorageConfig(AppConfig):
    name = "dashboard.storage"
    label = "storage"
    verbose_name = "Time-series tiers and partitions"
