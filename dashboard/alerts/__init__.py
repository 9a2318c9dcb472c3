"""Alerts: findings become webhooks (signed JSON, Slack, PagerDuty), delivered by Celery with retries and grouping.

The pieces: :mod:`planner` turns a ``finding_changed`` signal into Delivery rows (grouping, rate limit, resolve once),
:mod:`delivery` claims and sends one row, :mod:`tasks` runs that on Celery, :mod:`http` is the only outbound HTTP.
"""
