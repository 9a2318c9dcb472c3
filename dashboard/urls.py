from django.contrib.auth import views as auth_views
from django.urls import include, path

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="web/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("dashboard.ingest.urls")),
    path("", include("dashboard.api.urls")),
    path("", include("dashboard.diagnosis.urls")),
    path("doctor/", include("dashboard.doctor.urls")),
    path("", include("dashboard.web.urls")),
    path("", include("dashboard.alerts.urls")),
]
