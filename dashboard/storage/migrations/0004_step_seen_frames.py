# RollupState.step_seen_id named a StepSample id; the step rollup now finds late samples by StepFrame id
# (dashboard.storage.steps). A row id kept there would sit far above every frame id (a frame holds many samples), and
# the late-sample check would find nothing until frame ids caught up: it starts from the newest frame instead.

from typing import Any

from django.db import migrations


def to_frames(apps: Any, schema_editor: Any) -> None:
    state = apps.get_model("storage", "RollupState")
    frame = apps.get_model("telemetry", "StepFrame")
    newest = frame.objects.order_by("-id").values_list("id", flat=True).first()
    # No frame yet: 0, so the next pass checks every frame written from now on.
    state.objects.filter(step_seen_id__isnull=False).update(step_seen_id=newest or 0)


def to_rows(apps: Any, schema_editor: Any) -> None:
    state = apps.get_model("storage", "RollupState")
    row = apps.get_model("telemetry", "StepSample")
    newest = row.objects.order_by("-id").values_list("id", flat=True).first()
    state.objects.filter(step_seen_id__isnull=False).update(step_seen_id=newest or 0)


class Migration(migrations.Migration):

    dependencies = [
        ("storage", "0003_partition_frames"),
        ("telemetry", "0016_frames_backfill"),  # after the rows were framed: their frames are not late samples
    ]

    operations = [migrations.RunPython(to_frames, to_rows)]
