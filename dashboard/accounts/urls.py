from django.urls import path

from dashboard.accounts import views

urlpatterns = [
    path("account/tokens/", views.token_list, name="account-tokens"),
    path("account/tokens/<int:pk>/revoke/", views.token_revoke, name="account-token-revoke"),
]
