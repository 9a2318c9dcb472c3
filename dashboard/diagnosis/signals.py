"""``finding_changed`` is sent after the transaction that opened, escalated or resolved a finding has committed.

Receivers (the alerts app) get ``finding`` and ``event`` in {"opened", "escalated", "resolved"}."""

from django.dispatch import Signal

finding_changed = Signal()
