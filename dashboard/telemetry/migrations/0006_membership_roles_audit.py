import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    # The plain members many-to-many becomes the Membership model on the same table (state only), then gains a role:
    # every existing membership is kept, as "member".

    dependencies = [
        ('telemetry', '0005_ingesttoken_scope'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='Membership',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('cluster', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                                      related_name='memberships', to='telemetry.cluster')),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                                   related_name='memberships', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={'db_table': 'telemetry_cluster_members', 'unique_together': {('cluster', 'user')}},
                ),
                migrations.AlterField(
                    model_name='cluster',
                    name='members',
                    field=models.ManyToManyField(blank=True, related_name='clusters', through='telemetry.Membership',
                                                 to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
        migrations.AddField(
            model_name='membership',
            name='role',
            field=models.CharField(choices=[('viewer', 'Viewer'), ('member', 'Member'), ('owner', 'Owner')],
                                   default='member', max_length=8),
        ),
        migrations.CreateModel(
            name='AuditEntry',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('at', models.DateTimeField(auto_now_add=True, db_index=True)),
                ('actor_name', models.CharField(max_length=150)),
                ('action', models.CharField(max_length=48)),
                ('target', models.CharField(blank=True, max_length=255)),
                ('detail', models.JSONField(blank=True, default=dict)),
                ('actor', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                            related_name='+', to=settings.AUTH_USER_MODEL)),
                ('cluster', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE,
                                              related_name='audit', to='telemetry.cluster')),
            ],
            options={'indexes': [models.Index(fields=['cluster', '-at'], name='telemetry_a_cluster_f8f014_idx')]},
        ),
    ]
