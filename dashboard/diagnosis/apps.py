from django.apps import AppConfig


class DiagnosisConfig(AppConfig):
    name = "dashboard.diagnosis"
    label = "diagnosis"
    verbose_name = "Findings: what is holding a run back, and why"
