# The frame tables' partitions keep rows up to a page inline, uncompressed by PostgreSQL (their data is LZ4 already):
# dashboard.storage.partitions.STORAGE says why. New partitions get it as they are made; this sets it on those that
# exist. Frames already stored stay as they are.

from django.db import migrations


def inline(apps, schema_editor):  # noqa: ANN001, ANN201 (Django's migration signature)
    if schema_editor.connection.vendor != "postgresql":
        return
    from dashboard.storage.partitions import STORAGE, set_storage

    with schema_editor.connection.cursor() as cursor:
        for table in STORAGE:
            set_storage(cursor, table)


class Migration(migrations.Migration):

    dependencies = [
        ("storage", "0004_step_seen_frames"),
    ]

    operations = [migrations.RunPython(inline, migrations.RunPython.noop)]
