"""What each transport puts on the wire, checked on a real receiver (the webhook with the reference verifier)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from dashboard.alerts import webhook
from tests.alerts.alerts_support import Receiver, drain, make_finding, resolve, signal


def test_the_webhook_is_signed_per_standard_webhooks(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                    endpoint_for: Any) -> None:
    endpoint = endpoint_for(receiver)
    assert endpoint.secret.startswith("whsec_") and len(webhook.secret_key(endpoint.secret)) == 32
    finding = make_finding(cluster, node=nodes[1], gpu_index=4)
    signal(finding, "opened")
    drain()
    (got,) = receiver.requests
    assert got.verified is True
    assert got.headers["webhook-id"].startswith("msg_") and got.headers["content-type"] == "application/json"
    tampered = got.body.replace(b"node-001", b"node-009")
    with pytest.raises(WebhookVerificationError):
        Webhook(endpoint.secret).verify(tampered, got.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(webhook.new_secret()).verify(got.body, got.headers)


def test_the_signature_matches_the_spec_by_hand() -> None:
    # Recomputed from the spec's definition, independently of the reference library.
    import base64
    import hashlib
    import hmac

    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    body = b'{"a":1}'
    expected = base64.b64encode(hmac.new(b"k" * 32, b"msg_1.1700000000." + body, hashlib.sha256).digest()).decode()
    assert webhook.sign(secret, "msg_1", 1700000000, body) == f"v1,{expected}"


def test_the_webhook_payload_carries_the_finding(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                 endpoint_for: Any, settings: Any) -> None:
    settings.SITE_URL = "https://cdx.example.org"
    endpoint_for(receiver)
    finding = make_finding(cluster, node=nodes[1], gpu_index=4, severity="critical")
    signal(finding, "opened")
    drain()
    body = receiver.requests[0].json()
    assert body["type"] == "finding.opened"
    data = body["data"]
    assert (data["cluster"], data["event"], data["severity"]) == ("prod-a", "opened", "critical")
    assert data["link"] == f"https://cdx.example.org/findings/{finding.id}/", "an alert opens its finding's page"
    (f,) = data["findings"]
    assert (f["id"], f["kind"], f["subject"], f["node"], f["gpu_index"]) == (
        finding.id, "failing_gpu", "node-001/gpu4", "node-001", 4)
    assert f["action"] == "Drain the node and reseat the GPU"
    assert f["evidence"] == ["xid = 79", "ecc_dbe_rate_per_h = 0.5", "window = 60 s"]


def test_slack_gets_blocks_with_subject_evidence_action_and_link(cluster: Any, nodes: list[Any],
                                                                 receiver: Receiver, endpoint_for: Any) -> None:
    endpoint_for(receiver, kind="slack")
    finding = make_finding(cluster, node=nodes[0], gpu_index=2, severity="critical")
    signal(finding, "opened")
    drain()
    body = receiver.requests[0].json()
    assert body["text"] == ":rotating_light: Xid 79 on node-000/gpu2: GPU has fallen off the bus"
    kinds = [b["type"] for b in body["blocks"]]
    assert kinds == ["header", "section", "section", "section", "context", "actions"]
    text = json.dumps(body["blocks"])
    assert "`node-000/gpu2`" in text and "xid = 79" in text and "Drain the node and reseat the GPU" in text
    assert body["blocks"][-1]["elements"][0]["url"].endswith(f"/findings/{finding.id}/")
    assert "webhook-signature" not in receiver.requests[0].headers


def test_slack_escapes_its_control_characters(cluster: Any, nodes: list[Any], receiver: Receiver,
                                              endpoint_for: Any) -> None:
    endpoint_for(receiver, kind="slack")
    signal(make_finding(cluster, node=nodes[0], subject="<!channel> & co", action="a < b"), "opened")
    drain()
    body = receiver.requests[0].json()
    # Everything Slack parses as mrkdwn is escaped; the header is plain_text, which Slack never parses.
    parsed = [body["text"]] + [json.dumps(b) for b in body["blocks"] if b["type"] != "header"]
    assert all("<!channel>" not in text for text in parsed)
    assert "&lt;!channel&gt; &amp; co" in body["text"] and "a &lt; b" in parsed[-2]


def test_pagerduty_triggers_and_resolves_one_incident(cluster: Any, nodes: list[Any], receiver: Receiver,
                                                      endpoint_for: Any) -> None:
    endpoint_for(receiver, kind="pagerduty")
    finding = make_finding(cluster, node=nodes[0], gpu_index=1, severity="warning")
    signal(finding, "opened")
    drain()
    resolve(finding)
    drain()
    trigger, done = (r.json() for r in receiver.requests)
    key = f"clusterdx-{cluster.id}-finding-{finding.id}"
    assert (trigger["event_action"], trigger["dedup_key"], trigger["routing_key"]) == ("trigger", key, "R" * 32)
    assert trigger["payload"]["severity"] == "warning" and trigger["payload"]["source"] == "node-000"
    assert trigger["payload"]["custom_details"]["action"] == "Drain the node and reseat the GPU"
    assert trigger["links"][0]["href"].endswith(f"/findings/{finding.id}/")
    assert trigger["client_url"] == trigger["links"][0]["href"]
    assert done == {"routing_key": "R" * 32, "event_action": "resolve", "dedup_key": key}


@pytest.mark.parametrize(("kind", "url", "secret", "message"), [
    ("webhook", "https://hooks.example.org/x", "not-a-secret", "the secret must be whsec_ followed by base64"),
    ("webhook", "https://hooks.example.org/x", "whsec_c2hvcnQ=", "the secret must hold at least 24 random bytes"),
    ("pagerduty", "", "short", "the secret must be the 32-character routing (integration) key"),
    ("slack", "http://hooks.slack.com/services/x", "", "a Slack incoming-webhook URL starts with https://"),
    ("webhook", "ftp://hooks.example.org/x", "", "the URL must be http:// or https:// with a host"),
    ("sms", "https://x.example.org", "", "unknown kind 'sms': use one of webhook, slack, pagerduty"),
])
def test_it_refuses_a_bad_endpoint(cluster: Any, kind: str, url: str, secret: str, message: str,
                                   alerts_settings: dict[str, Any]) -> None:
    from dashboard.alerts import endpoints

    alerts_settings["ALERTS_ALLOW_PRIVATE"] = False

    with pytest.raises(ValueError) as err:
        endpoints.create(cluster, name="x", kind=kind, url=url, secret=secret)
    assert str(err.value) == message
