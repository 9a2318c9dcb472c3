from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('telemetry', '0002_agentbatch_sent_at'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='rack',
            field=models.CharField(blank=True, default='', max_length=64),
        ),
        migrations.AddField(
            model_name='node',
            name='switch',
            field=models.CharField(blank=True, default='', max_length=64),
        ),
    ]
