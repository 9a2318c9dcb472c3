from django.db import migrations, models


def auto_for_the_old_default(apps, schema_editor):  # noqa: ANN001
    # "ib" was the default nobody could change (no page or command set it): it becomes "use the detected one".
    # "eth" was set on purpose (shell or admin) and stays an override.
    apps.get_model("telemetry", "Cluster").objects.filter(interconnect="ib").update(interconnect="auto")


def back_to_ib(apps, schema_editor):  # noqa: ANN001
    apps.get_model("telemetry", "Cluster").objects.filter(interconnect__in=["auto", "roce"]).update(interconnect="ib")


class Migration(migrations.Migration):

    dependencies = [
        ('telemetry', '0006_membership_roles_audit'),
    ]

    operations = [
        migrations.AlterField(
            model_name='cluster',
            name='interconnect',
            field=models.CharField(choices=[('auto', 'Detected'), ('ib', 'InfiniBand'), ('roce', 'RoCE'),
                                            ('eth', 'Ethernet')], default='auto', max_length=16),
        ),
        migrations.RunPython(auto_for_the_old_default, back_to_ib),
    ]
