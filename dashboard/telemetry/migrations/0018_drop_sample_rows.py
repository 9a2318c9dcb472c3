# The row tables of GPU samples, steps and probes go: every reader reads their frames (0015), and the rows stored
# before frames existed were framed by 0016. Dropped whole (no RemoveField first: on SQLite each would copy the table
# once more before it is dropped); on PostgreSQL a dropped table takes its day partitions with it.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('telemetry', '0017_probe_inbound'),
        ('storage', '0004_step_seen_frames'),  # it read the newest step row's id
    ]

    operations = [
        migrations.DeleteModel(name='GpuSample'),
        migrations.DeleteModel(name='Probe'),
        migrations.DeleteModel(name='StepSample'),
    ]
