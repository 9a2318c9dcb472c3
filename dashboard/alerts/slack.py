"""Slack incoming webhooks: a message in Block Kit, with a plain ``text`` fallback for notifications."""

from __future__ import annotations

from typing import Any

from dashboard.alerts import conf
from dashboard.alerts.alert import Alert
from dashboard.alerts.base import Transport

EMOJI = {"info": ":information_source:", "warning": ":warning:", "error": ":red_circle:",
         "critical": ":rotating_light:"}
MAX_LISTED = 10  # a storm is listed, up to this many subjects, in one message


def _mrkdwn(text: str) -> str:
    # Slack treats &, < and > as control characters in mrkdwn.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Slack(Transport):
    kind = "slack"

    @classmethod
    def clean_config(cls, url: str, secret: str) -> tuple[str, str]:
        # The URL is the credential: never in clear text, except to an on-premises Slack-compatible receiver
        # (Mattermost, Rocket.Chat) where private destinations are explicitly allowed.
        if not url.startswith("https://") and not conf.allow_private():
            raise ValueError("a Slack incoming-webhook URL starts with https://")
        return url, ""

    def body(self, alert: Alert) -> dict[str, Any]:
        emoji = ":white_check_mark:" if alert.event == "resolved" else EMOJI.get(alert.severity, "")
        title = f"{emoji} {alert.title}".strip()
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": title[:150], "emoji": True}},
            {"type": "section", "fields": [
                {"type": "mrkdwn", "text": f"*Cluster*\n{_mrkdwn(alert.cluster)}"},
                {"type": "mrkdwn", "text": f"*Severity*\n{alert.severity}"},
            ]},
        ]
        blocks += self._finding_blocks(alert)
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in clusterdx"}, "url": alert.link}]})
        return {"text": _mrkdwn(title), "blocks": blocks}  # the fallback text is parsed as mrkdwn

    def _finding_blocks(self, alert: Alert) -> list[dict[str, Any]]:
        if not alert.findings:
            return [{"type": "section", "text": {"type": "mrkdwn", "text": "Alerts from clusterdx reach this channel."}}]
        head = alert.findings[0]
        blocks: list[dict[str, Any]] = []
        subjects = [f"`{_mrkdwn(f['subject'])}` {_mrkdwn(f['title'])}" for f in alert.findings[:MAX_LISTED]]
        if len(alert.findings) > MAX_LISTED:
            subjects.append(f"…and {len(alert.findings) - MAX_LISTED} more")
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "*Subject*\n" + "\n".join(subjects)}})
        if head["evidence"]:
            text = "*Evidence*\n" + "\n".join(f"• {_mrkdwn(line)}" for line in head["evidence"])
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": text[:2900]}})
        if head["action"] and alert.event != "resolved":
            blocks.append({"type": "context", "elements": [
                {"type": "mrkdwn", "text": f"*Suggested action:* {_mrkdwn(head['action'])[:2900]}"}]})
        if head.get("acked_by"):  # a resolve of an acknowledged finding: who was on it
            blocks.append({"type": "context", "elements": [
                {"type": "mrkdwn", "text": f"Acknowledged by {_mrkdwn(head['acked_by'])}"}]})
        return blocks
