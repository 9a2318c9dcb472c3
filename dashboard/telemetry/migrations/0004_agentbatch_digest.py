from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('telemetry', '0003_node_rack_switch'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentbatch',
            name='digest',
            field=models.CharField(blank=True, default='', max_length=64),
        ),
    ]
