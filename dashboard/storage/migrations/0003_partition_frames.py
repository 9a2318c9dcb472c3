# The frame tables (telemetry 0015) partitioned by day on PostgreSQL, as the row tables they replace are
# (storage 0001): retention drops whole days of frames.

from django.db import migrations

FRAMES = ["telemetry_gpuframe", "telemetry_stepframe", "telemetry_probeframe"]


def partition(apps, schema_editor):  # noqa: ANN001, ANN201 (Django's migration signature)
    if schema_editor.connection.vendor != "postgresql":
        return
    from dashboard.storage.partitions import partition_table

    with schema_editor.connection.cursor() as cursor:
        for table in FRAMES:
            partition_table(cursor, table)


class Migration(migrations.Migration):

    dependencies = [
        ("storage", "0002_step_rollup"),
        ("telemetry", "0015_frames"),
    ]

    operations = [migrations.RunPython(partition, migrations.RunPython.noop)]
