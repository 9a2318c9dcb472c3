from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard import sso

urlpatterns = [
    path("login/", sso.LoginView.as_view(), name="login"),  # the local form, and "Sign in with SSO" when configured
    path("", include("dashboard.sso")),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("dashboard.ingest.urls")),
    path("", include("dashboard.api.urls")),
    path("", include("dashboard.telemetry.probe_api")),
    path("", include("dashboard.diagnosis.urls")),
    path("doctor/", include("dashboard.doctor.urls")),
    path("", include("dashboard.web.urls")),
    path("", include("dashboard.alerts.urls")),
    path("", include("dashboard.accounts.urls")),
]
