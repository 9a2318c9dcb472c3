from django.db import migrations, models


class Migration(migrations.Migration):
    # Existing tokens become "cluster" tokens: they keep posting anything as any node, as before.

    dependencies = [
        ('telemetry', '0004_agentbatch_digest'),
    ]

    operations = [
        migrations.AddField(
            model_name='ingesttoken',
            name='scope',
            field=models.CharField(choices=[('cluster', 'cluster'), ('agent', 'agent'), ('hook', 'hook')],
                                   default='cluster', max_length=8),
        ),
        migrations.AddField(
            model_name='ingesttoken',
            name='hosts',
            field=models.CharField(blank=True, default='', max_length=1024),
        ),
    ]
