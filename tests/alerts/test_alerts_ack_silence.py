"""Acknowledged findings and silenced subjects alert nobody, end to end: findings made by the diagnosis lifecycle
(``reconcile``: the outbox in the finding's transaction, the fast path after the commit), planned by the real planner,
sent by the embedded sweep to a real HTTP receiver. Held-back alerts are rows with the reason; when a silence ends,
the sweep sends what it held back for findings still open."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from dashboard.alerts import planner
from dashboard.alerts.models import Delivery
from dashboard.diagnosis import silences
from dashboard.diagnosis.detectors.base import Detection
from dashboard.diagnosis.lifecycle import reconcile
from dashboard.diagnosis.live import finding_row
from dashboard.diagnosis.models import Finding, Silence
from dashboard.telemetry.models import AuditEntry
from tests.alerts.alerts_support import Receiver, drain
from tests.alerts.test_alerts_outbox import embedded_sweep

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit hooks run, as in a diagnosis pass
S = Delivery.Status


@pytest.fixture
def member(cluster: Any, django_user_model: Any) -> Any:
    user = django_user_model.objects.create_user("alice")
    cluster.members.add(user, through_defaults={"role": "member"})
    return user


@pytest.fixture(autouse=True)
def no_grouping_window(alerts_settings: dict[str, Any], settings: Any) -> None:
    """Each alert stands alone: a finding reopened a minute later would otherwise fold into the first one's alert."""
    settings.CLUSTERDX = {**alerts_settings, "ALERTS_GROUP_WINDOW_S": 0.0}


def gpu(host: str, index: int, severity: str = "error") -> Detection:
    return Detection(kind="throttling", subject_type="gpu", subject=f"{host}/gpu{index}", severity=severity,
                     title=f"{host}/gpu{index} throttles at 92 C", action="Check the airflow", evidence={},
                     node=host, gpu_index=index)


def link(a: str, b: str) -> Detection:
    return Detection(kind="slow_link", subject_type="link", subject=f"{a}~{b}", severity="error",
                     title=f"{a}~{b} runs at 40% of its peers", action="Reseat the cable", evidence={},
                     node=a, peer_node=b)


def types(receiver: Receiver) -> list[tuple[str, str]]:
    return [(r.json()["type"], r.json()["data"]["findings"][0]["subject"]) for r in receiver.requests]


def passes(cluster: Any, detections: list[Detection], t0: Any, *seconds: float) -> None:
    """Diagnosis passes at t0 + each offset (two passes a minute apart resolve what is gone: the hysteresis)."""
    for s in seconds:
        reconcile(cluster, detections, t0 + timedelta(seconds=s))
    drain()


def test_it_stops_re_alerting_an_acknowledged_finding_until_it_resolves(cluster: Any, nodes: list[Any],
                                                                        receiver: Receiver, endpoint_for: Any,
                                                                        member: Any) -> None:
    endpoint_for(receiver)
    t0 = timezone.now()
    passes(cluster, [gpu("node-000", 0)], t0, 0)
    first = Finding.objects.get()
    assert silences.acknowledge(first, member) and not silences.acknowledge(first, member)  # a double click
    assert finding_row(first)["acked_by"] == "alice"

    passes(cluster, [gpu("node-000", 0, "critical")], t0, 10)  # escalated: would page again
    held = Delivery.objects.get(event="escalated")
    assert held.status == S.SUPPRESSED and held.last_error.startswith("acknowledged by alice at ")
    assert types(receiver) == [("finding.opened", "node-000/gpu0")]

    passes(cluster, [], t0, 60, 120)  # resolved: the notice closes the incident the alert opened
    assert types(receiver)[-1] == ("finding.resolved", "node-000/gpu0")
    assert receiver.requests[-1].json()["data"]["findings"][0]["acked_by"] == "alice"

    passes(cluster, [gpu("node-000", 0)], t0, 180)  # the condition is back: a new finding, which alerts again
    again = Finding.objects.get(state="open")
    assert again.id != first.id and again.acked_at is None
    assert types(receiver) == [("finding.opened", "node-000/gpu0"), ("finding.resolved", "node-000/gpu0"),
                               ("finding.opened", "node-000/gpu0")]
    assert list(AuditEntry.objects.values_list("action", "actor_name", "target")) == [
        ("finding.ack", "alice", f"finding {first.id}")]


def test_a_silenced_node_alerts_nothing_until_the_silence_ends(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                               endpoint_for: Any, member: Any) -> None:
    endpoint_for(receiver)
    silence = silences.create_silence(cluster, member, "node", "node-001", 60, "maintenance: reseating GPUs")
    t0 = timezone.now()
    during = [gpu("node-001", 0), gpu("node-001", 3), link("node-000", "node-001"), gpu("node-002", 0)]
    passes(cluster, during, t0, 0)
    # The findings open and show, marked; only the node outside the silence alerts.
    assert types(receiver) == [("finding.opened", "node-002/gpu0")]
    rows = silences.mark([finding_row(f) for f in Finding.objects.select_related("node", "cluster", "peer_node")])
    assert {r["subject"]: (r["silenced"] or {}).get("id") for r in rows} == {
        "node-001/gpu0": silence.id, "node-001/gpu3": silence.id, "node-000~node-001": silence.id,
        "node-002/gpu0": None}
    held = Delivery.objects.filter(finding__subject="node-001/gpu0").get()
    assert held.status == S.SUPPRESSED and held.last_error.endswith(
        f"by alice (silence {silence.id}): maintenance: reseating GPUs")

    passes(cluster, during[:1] + during[2:], t0, 60, 120)  # gpu3 resolves during the silence: nothing to resolve
    assert len(receiver.requests) == 1
    assert Delivery.objects.get(finding__subject="node-001/gpu3", event="resolved").status == S.SUPPRESSED

    assert silences.end_silence(silence, member) and not silences.end_silence(silence, member)
    embedded_sweep()
    drain()
    assert sorted(types(receiver)[1:]) == [("finding.opened", "node-000~node-001"),
                                           ("finding.opened", "node-001/gpu0")]
    embedded_sweep()  # claimed once: a second sweep (or a second worker) sends nothing more
    assert len(receiver.requests) == 3 and Silence.objects.get().released_at is not None

    passes(cluster, [gpu("node-002", 0)], t0, 180, 240)  # the alerts sent after the silence get their resolves
    assert sorted(types(receiver)[3:]) == [("finding.resolved", "node-000~node-001"),
                                           ("finding.resolved", "node-001/gpu0")]
    assert list(AuditEntry.objects.order_by("id").values_list("action", "target")) == [
        ("silence.create", "node node-001"), ("silence.end", "node node-001")]


def test_an_expired_silence_releases_open_findings_except_acknowledged_ones(cluster: Any, nodes: list[Any],
                                                                           receiver: Receiver, endpoint_for: Any,
                                                                           member: Any) -> None:
    endpoint_for(receiver)
    silence = silences.create_silence(cluster, member, "kind", "throttling", 30, "known hot aisle, facilities on it")
    passes(cluster, [gpu("node-000", 0), gpu("node-002", 1)], timezone.now(), 0)
    assert not receiver.requests and Delivery.objects.filter(status=S.SUPPRESSED).count() == 2
    silences.acknowledge(Finding.objects.get(subject="node-000/gpu0"), member)

    assert planner.silences_due() == []  # still active
    Silence.objects.filter(id=silence.id).update(ends_at=timezone.now() - timedelta(seconds=1))  # time passed
    embedded_sweep()
    drain()
    assert types(receiver) == [("finding.opened", "node-002/gpu1")]
    after = Delivery.objects.get(finding__subject="node-000/gpu0", dedup__contains="after-silence")
    assert after.status == S.SUPPRESSED and after.last_error.startswith("acknowledged by alice")
