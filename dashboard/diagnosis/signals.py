"""Signals about findings, for apps that act on them (the alerts app).

``finding_recorded`` is sent *inside* the transaction that opened, escalated or resolved a finding: a receiver's
writes commit or roll back with the change (the alerts app writes its outbox row here, so a crash after the commit
cannot lose the alert). A receiver that raises aborts that change, so receivers only write a row.

``finding_changed`` is sent after that transaction has committed (the fast path: plan the alerts now).

Both carry ``finding`` and ``event`` in {"opened", "escalated", "resolved"}."""

from django.dispatch import Signal

finding_recorded = Signal()
finding_changed = Signal()
