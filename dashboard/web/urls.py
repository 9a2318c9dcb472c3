from django.urls import path

from dashboard.web import views

urlpatterns = [
    path("", views.home, name="home"),
    path("clusters/<slug:name>/", views.cluster_detail, name="cluster"),
    path("runs/<int:run_id>/", views.run_detail, name="run"),
]
