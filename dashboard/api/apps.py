from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "dashboard.api"
    label = "api"
