from django.urls import path

from dashboard.api.views import openapi

urlpatterns = [path("api/openapi.json", openapi, name="openapi")]
