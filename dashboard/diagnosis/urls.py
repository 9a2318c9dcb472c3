from django.urls import path

from dashboard.diagnosis import views

urlpatterns = [
    path("api/v1/findings", views.findings, name="findings"),
    path("api/v1/runs/<int:run_id>/steps/<int:step>/explain", views.explain, name="explain-step"),
]
