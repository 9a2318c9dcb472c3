from importlib import import_module

from django.urls import include, path

from dashboard.web import views
from dashboard.web.pages import PAGES

urlpatterns = [
    path("", views.home, name="home"),
    *[path("", include(import_module(f"dashboard.web.pages.{page}"))) for page in PAGES],
]
