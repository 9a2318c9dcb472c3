"""The log doctor page: signed-in users get the report, anonymous users the login page, oversized uploads a message."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import include, path

from dashboard.urls import urlpatterns as _site

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
# Until the lead mounts the app in dashboard/urls.py this module stands in as the URLconf (same site plus the page).
urlpatterns = [*_site, path("doctor/", include("dashboard.doctor.urls"))]

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]


@pytest.fixture(autouse=True)
def _app_installed(settings):
    if "dashboard.doctor" not in settings.INSTALLED_APPS:
        settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, "dashboard.doctor"]


@pytest.fixture
def signed_in(client, django_user_model):
    user = django_user_model.objects.create_user("oncall", password="pw-oncall-1")
    client.force_login(user)
    return client


def test_it_redirects_anonymous_users_to_login(client):
    response = client.get("/doctor/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_it_shows_the_verdict_for_pasted_text(signed_in):
    text = (LOGS / "xid_79_journalctl_open_gpu_1151.log").read_text()
    response = signed_in.post("/doctor/", {"text": text, "kind": ""})
    body = response.content.decode()
    assert response.status_code == 200
    assert "Xid 79 on GPU 0000:2b:00.0" in body and "Drain the node" in body


def test_it_reads_an_uploaded_file(signed_in):
    upload = SimpleUploadedFile("rank0.log", (LOGS / "nccl_socket_ib_disabled_mpi.log").read_bytes())
    body = signed_in.post("/doctor/", {"file": upload}).content.decode()
    assert "NCCL_IB_DISABLE=1" in body


def test_a_too_big_upload_gets_a_clear_message(signed_in, monkeypatch):
    monkeypatch.setattr("dashboard.doctor.views.MAX_UPLOAD_BYTES", 1024)
    upload = SimpleUploadedFile("huge.log", b"x" * 4096)
    response = signed_in.post("/doctor/", {"file": upload})
    assert response.status_code == 413
    assert "the page takes up to" in response.content.decode()


def test_an_empty_form_asks_for_input(signed_in):
    response = signed_in.post("/doctor/", {"text": ""})
    assert response.status_code == 400 and "Paste a log" in response.content.decode()


def test_pasted_text_over_djangos_form_limit_gets_a_clear_message(signed_in, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    response = signed_in.post("/doctor/", {"text": "x" * 4096})
    assert response.status_code == 413
    assert "Upload it as a file" in response.content.decode()


def test_a_hostile_upload_gets_a_verdict(signed_in):
    line = "h:1:2 [0] NCCL INFO Using network a" + " " * 60000 + "x\n"  # quadratic in the old regex
    upload = SimpleUploadedFile("hostile.log", (line * 64).encode())
    response = signed_in.post("/doctor/", {"file": upload})
    assert response.status_code == 200 and "Verdict" in response.content.decode()
