from django.urls import path

from dashboard.alerts import views

urlpatterns = [
    path("clusters/<slug:name>/alerts/", views.endpoint_list, name="alerts"),
    path("clusters/<slug:name>/alerts/deliveries/", views.delivery_log, name="alerts-deliveries"),
    path("clusters/<slug:name>/alerts/<int:pk>/<str:action>/", views.endpoint_action, name="alerts-action"),
]
