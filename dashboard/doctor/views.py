"""The log doctor page: paste or upload a log, read the same report `clusterdx doctor` prints.

The upload is streamed straight into the parsers; its size is checked first so a pasted multi-gigabyte log gets a
clear message instead of tying up a worker. The parsers cut every line to a few KB and run in linear time, so the
largest accepted upload costs well under a second of CPU whatever it holds.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from collectors.doctor import KINDS, diagnose

MAX_UPLOAD_BYTES = 20 * 1024 * 1024


@login_required
def doctor(request: HttpRequest) -> HttpResponse:
    context: dict[str, object] = {"kinds": KINDS, "max_mb": MAX_UPLOAD_BYTES // (1024 * 1024)}
    if request.method == "POST":
        context.update(_diagnose(request))
    status = 413 if context.get("too_big") else 400 if context.get("error") else 200
    return render(request, "doctor/doctor.html", context, status=status)


def _diagnose(request: HttpRequest) -> dict[str, object]:
    try:
        return _diagnose_form(request)
    except RequestDataTooBig:
        # Django refuses form fields (the pasted text) over DATA_UPLOAD_MAX_MEMORY_SIZE; files are not counted.
        limit_mb = (settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0) / 2**20
        return {"error": f"The pasted text is over {limit_mb:g} MB, the most the page takes as text. Upload it as a "
                         f"file (up to {MAX_UPLOAD_BYTES // 2**20} MB) or run `clusterdx doctor FILE`.",
                "too_big": True}


def _diagnose_form(request: HttpRequest) -> dict[str, object]:
    kind = request.POST.get("kind") or None
    if kind is not None and kind not in KINDS:
        return {"error": f"Unknown kind {kind!r}."}
    upload = request.FILES.get("file")
    text = request.POST.get("text", "")
    if upload is not None:
        if upload.size > MAX_UPLOAD_BYTES:
            limit_mb = MAX_UPLOAD_BYTES // 2**20
            return {"error": f"The file is {upload.size / 1e6:.1f} MB; the page takes up to {limit_mb} MB. "
                             "Run `clusterdx doctor FILE` on the machine instead: it streams any size.",
                    "too_big": True}
        source: object = upload.file
    elif text.strip():
        if len(text) > MAX_UPLOAD_BYTES:
            return {"error": "The pasted text is too long for the page; use `clusterdx doctor FILE`.", "too_big": True}
        source = text
    else:
        return {"error": "Paste a log or choose a file."}
    report = diagnose([source], kind=kind)  # type: ignore[list-item]
    return {"report": report, "report_text": report.render_text(), "kind_chosen": kind or ""}
