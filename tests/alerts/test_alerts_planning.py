"""From finding events to alerts: endpoint filters, one alert per storm, the rate limit, one resolve per alert."""

from __future__ import annotations

from typing import Any

from dashboard.alerts.models import Delivery
from dashboard.alerts.tasks import send_due
from tests.alerts.alerts_support import Receiver, drain, make_finding, resolve, signal

S = Delivery.Status


def xid_storm(cluster: Any, node: Any, gpus: int = 8, severity: str = "error") -> list[Any]:
    findings = [make_finding(cluster, node=node, gpu_index=i, severity=severity) for i in range(gpus)]
    for f in findings:
        signal(f, "opened")
    return findings


def test_it_sends_a_storm_on_one_node_as_one_alert(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                  endpoint_for: Any) -> None:
    endpoint_for(receiver)
    storm = xid_storm(cluster, nodes[3])
    drain()
    assert len(receiver.requests) == 1
    data = receiver.requests[0].json()["data"]
    assert [f["subject"] for f in data["findings"]] == [f"node-003/gpu{i}" for i in range(8)]
    assert data["title"].endswith("(+7 more on node-003)")
    rows = Delivery.objects.order_by("id")
    assert [r.status for r in rows] == [S.DELIVERED] + [S.GROUPED] * 7
    assert {r.group_id for r in rows[1:]} == {rows[0].id} and rows[0].finding_id == storm[0].id


def test_it_keeps_nodes_and_kind_families_apart(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                endpoint_for: Any) -> None:
    endpoint_for(receiver)
    signal(make_finding(cluster, node=nodes[0], gpu_index=0), "opened")
    signal(make_finding(cluster, node=nodes[1], gpu_index=0), "opened")
    signal(make_finding(cluster, node=nodes[0], kind="slow_link", subject="node-000~node-001"), "opened")
    signal(make_finding(cluster, node=nodes[0], kind="thermal", gpu_index=1), "opened")  # gpu family: grouped
    drain()
    subjects = sorted(tuple(f["subject"] for f in r.json()["data"]["findings"]) for r in receiver.requests)
    assert subjects == [("node-000/gpu0", "node-000/gpu1"), ("node-000~node-001",), ("node-001/gpu0",)]


def test_it_folds_a_late_finding_of_a_sent_group_unless_it_is_more_severe(cluster: Any, nodes: list[Any],
                                                                          receiver: Receiver,
                                                                          endpoint_for: Any) -> None:
    endpoint_for(receiver)
    xid_storm(cluster, nodes[0], gpus=2)
    drain()
    signal(make_finding(cluster, node=nodes[0], gpu_index=5, severity="warning"), "opened")
    signal(make_finding(cluster, node=nodes[0], gpu_index=6, severity="critical"), "opened")
    drain()
    assert len(receiver.requests) == 2
    assert receiver.requests[1].json()["data"]["findings"][0]["subject"] == "node-000/gpu6"
    late = Delivery.objects.get(finding__subject="node-000/gpu5")
    assert late.status == S.GROUPED and late.last_error == f"folded into delivery {late.group_id}, already sent: " \
                                                         "not sent again"


def test_it_rate_limits_each_endpoint(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any) -> None:
    limited = endpoint_for(receiver, max_per_hour=2)
    other = Receiver()
    try:
        endpoint_for(other)
        for node in nodes:  # four nodes: four groups, four alerts wanted
            signal(make_finding(cluster, node=node, gpu_index=0), "opened")
        drain()
        assert len(receiver.requests) == 2 and len(other.requests) == 4
        suppressed = Delivery.objects.filter(endpoint=limited, status=S.SUPPRESSED)
        assert [r.last_error for r in suppressed] == [
            "rate limit: 2 alerts in the last hour (this endpoint allows 2)"] * 2
    finally:
        other.stop()


def test_it_sends_one_resolve_when_the_last_finding_of_an_alert_resolves(cluster: Any, nodes: list[Any],
                                                                        receiver: Receiver,
                                                                        endpoint_for: Any) -> None:
    endpoint_for(receiver, kind="pagerduty")
    storm = xid_storm(cluster, nodes[2], gpus=3)
    drain()
    resolve(storm[1])
    resolve(storm[0])
    drain()
    assert len(receiver.requests) == 1  # one finding of the alert is still open
    resolve(storm[2])
    signal(storm[2], "resolved")  # a repeated signal
    signal(storm[0], "resolved")
    drain()
    bodies = [r.json() for r in receiver.requests]
    assert [b["event_action"] for b in bodies] == ["trigger", "resolve"]
    assert bodies[0]["dedup_key"] == bodies[1]["dedup_key"] == f"clusterdx-{cluster.id}-finding-{storm[0].id}"
    assert Delivery.objects.filter(event="resolved").count() == 1


def test_a_resolve_waits_for_its_trigger(cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any,
                                         alerts_settings: dict[str, Any]) -> None:
    from tests.alerts.alerts_support import Reply

    receiver.script = [Reply(503)]
    alerts_settings["ALERTS_BACKOFF_BASE_S"] = alerts_settings["ALERTS_BACKOFF_MAX_S"] = 0.3
    endpoint_for(receiver, kind="pagerduty")
    finding = make_finding(cluster, node=nodes[0], gpu_index=0)
    signal(finding, "opened")
    send_due()  # the trigger fails once and waits for its retry
    resolve(finding)
    send_due()
    assert len(receiver.requests) == 1  # the resolve did not overtake the trigger
    drain()
    assert [(r.json()["event_action"], r.answered) for r in receiver.requests] == [
        ("trigger", 503), ("trigger", 200), ("resolve", 200)]


def test_it_sends_no_resolve_for_what_it_never_sent(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                    endpoint_for: Any) -> None:
    endpoint_for(receiver, min_severity="error")
    quiet = make_finding(cluster, node=nodes[0], gpu_index=0, severity="warning")
    signal(quiet, "opened")
    resolve(quiet)
    drain()
    assert receiver.requests == [] and not Delivery.objects.exists()


def test_it_filters_by_severity_and_kind_and_alerts_when_an_escalation_crosses_the_bar(
        cluster: Any, nodes: list[Any], receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver, min_severity="error", kinds=["failing_gpu"])
    warm = make_finding(cluster, node=nodes[0], gpu_index=0, severity="warning")
    signal(warm, "opened")
    signal(make_finding(cluster, node=nodes[1], kind="straggler", subject="rank5", severity="critical"), "opened")
    drain()
    assert receiver.requests == []
    warm.severity = "critical"
    warm.save(update_fields=["severity"])
    signal(warm, "escalated")
    signal(warm, "escalated")  # repeated: still one
    drain()
    assert [r.json()["type"] for r in receiver.requests] == ["finding.escalated"]
    assert receiver.requests[0].json()["data"]["title"].startswith("Escalated: Xid 79 on node-000/gpu0")


def test_a_disabled_endpoint_gets_nothing(cluster: Any, nodes: list[Any], receiver: Receiver,
                                          endpoint_for: Any) -> None:
    endpoint = endpoint_for(receiver)
    signal(make_finding(cluster, node=nodes[0], gpu_index=0), "opened")
    endpoint.enabled = False
    endpoint.save()
    signal(make_finding(cluster, node=nodes[1], gpu_index=0), "opened")
    drain()
    assert receiver.requests == []
    assert [(d.status, d.last_error) for d in Delivery.objects.all()] == [
        (S.SUPPRESSED, "endpoint disabled before sending")]


def test_a_failing_planner_never_breaks_the_detector(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                     endpoint_for: Any, monkeypatch: Any, caplog: Any) -> None:
    from dashboard.alerts import planner

    endpoint_for(receiver)

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(planner, "plan_alert", broken)
    signal(make_finding(cluster, node=nodes[0], gpu_index=0), "opened")  # does not raise
    assert "planning deliveries for finding" in caplog.text and "boom" in caplog.text


def test_no_resolve_follows_a_trigger_that_finally_failed(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                          endpoint_for: Any) -> None:
    from tests.alerts.alerts_support import Reply

    receiver.script = [Reply(503), Reply(404)]
    endpoint_for(receiver, kind="pagerduty")
    finding = make_finding(cluster, node=nodes[0], gpu_index=0)
    signal(finding, "opened")
    send_due()  # 503: the trigger will be retried
    resolve(finding)  # planned while the trigger is still alive
    drain()
    assert [(r.json()["event_action"], r.answered) for r in receiver.requests] == [("trigger", 503), ("trigger", 404)]
    trigger, undo = Delivery.objects.order_by("id")
    assert (undo.status, undo.last_error) == (
        S.SUPPRESSED, f"delivery {trigger.id}, which this would resolve, was not delivered (failed)")
