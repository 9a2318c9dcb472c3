from django.apps import AppConfig


class DoctorConfig(AppConfig):
    name = "dashboard.doctor"
    label = "doctor"
    verbose_name = "Log doctor"
