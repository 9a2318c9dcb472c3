from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "dashboard.alerts"
    label = "alerts"
    verbose_name = "Alerts: webhooks, Slack and PagerDuty for findings"

    def ready(self) -> None:
        from dashboard.alerts import conf, planner
        from dashboard.diagnosis.signals import finding_changed

        conf.check()  # a typo in an alerts variable fails at start-up, not at 3 AM
        finding_changed.connect(planner.on_finding_changed, dispatch_uid="dashboard.alerts")
