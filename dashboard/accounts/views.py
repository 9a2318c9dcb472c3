"""``/account/tokens/``: a user's personal API tokens. Create (the secret is in that one response), list, revoke."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from dashboard.accounts import tokens
from dashboard.accounts.models import PersonalToken


class TokenForm(forms.Form):
    name = forms.CharField(max_length=64, required=False, help_text="what it is for, e.g. 'grafana' or 'notebook'")


@login_required
@require_http_methods(["GET", "POST"])
def token_list(request: HttpRequest) -> HttpResponse:
    form = TokenForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        row, secret = tokens.create(request.user, form.cleaned_data["name"])
        # Rendered, not redirected: the secret is in this one response and stored in no session or cookie.
        return render(request, "accounts/tokens.html", {"rows": _rows(request), "form": TokenForm(),
                                                        "created": row, "secret": secret})
    return render(request, "accounts/tokens.html", {"rows": _rows(request), "form": form})


@login_required
@require_POST
def token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    # Another user's token id is a 404, like every object one may not see.
    row = get_object_or_404(PersonalToken.objects.select_related("user"), pk=pk, user=request.user)
    if tokens.revoke(row, actor=request.user):
        messages.info(request, f"token {row.prefix} revoked")
    return redirect("account-tokens")


def _rows(request: HttpRequest) -> list[PersonalToken]:
    return list(PersonalToken.objects.filter(user=request.user).order_by("-created_at", "-id"))
