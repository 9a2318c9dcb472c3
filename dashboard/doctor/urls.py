from django.urls import path

from dashboard.doctor import views

urlpatterns = [path("", views.doctor, name="doctor")]
