"""The embedded channel layer shares each message between its receivers instead of deep-copying it per browser,
which is safe only while nothing mutates a message after it is sent: the publisher builds each one fresh, and the
live consumer builds its own lists from it. Both halves are held here."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from channels.exceptions import ChannelFull

from dashboard.live.consumers import LiveConsumer
from dashboard.live.layer import LocalChannelLayer


def test_every_receiver_gets_the_one_message_sent() -> None:
    layer = LocalChannelLayer(capacity=2)

    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        a, b = await layer.new_channel(), await layer.new_channel()
        await layer.group_add("cluster-1", a)
        await layer.group_add("cluster-1", b)
        message = {"type": "live.event", "event": {"type": "gpus", "cluster": 1, "gpus": [["node-000", 0, 1.0]]}}
        await layer.group_send("cluster-1", message)
        return [await layer.receive(a), await layer.receive(b)], message

    got, sent = asyncio.run(scenario())
    assert got[0] is sent and got[1] is sent


def test_a_full_channel_is_refused_as_channels_does() -> None:
    layer = LocalChannelLayer(capacity=1)

    async def scenario() -> None:
        await layer.send("one", {"type": "x"})
        with pytest.raises(ChannelFull):
            await layer.send("one", {"type": "x"})

    asyncio.run(scenario())


@pytest.mark.parametrize(("host", "run_hosts"), [(None, None), ("node-001", None), (None, {"node-000"})])
def test_the_live_consumer_never_mutates_a_message(host: str | None, run_hosts: set[str] | None) -> None:
    client = LiveConsumer()
    client.only, client.host, client.run_hosts, client.pending = None, host, run_hosts, {}
    events = [
        {"type": "gpus", "cluster": 1, "gpus": [["node-000", 0, 1.0, 50.0], ["node-001", 3, 1.0, 90.0]]},
        {"type": "steps", "run": 4, "steps": [[10, 0, 1.0, 0.5, 0.01, 0.4, 0.09, 4096]]},
        {"type": "findings", "cluster": 1, "findings": [{"id": 9, "state": "open", "updated_at": 2.0}]},
        {"type": "events", "cluster": 1, "events": [{"ts": 1.0, "host": "node-001", "kind": "xid", "code": 79}]},
    ]
    before = copy.deepcopy(events)

    async def feed() -> None:
        for event in events * 2:  # twice: merging into what is already pending must not touch the message either
            await client.live_event({"type": "live.event", "event": event})

    asyncio.run(feed())
    assert events == before
    assert client.pending  # it did take something from them


def test_what_the_publisher_sent_is_never_touched_again() -> None:
    from dashboard.live.publish import Coalescer

    merge = Coalescer()
    gpus = {"type": "gpus", "cluster": 1, "gpus": [["node-000", 0, 1.0, 50.0]]}
    steps = {"type": "steps", "run": 4, "steps": [[10, 0, 1.0, 0.5, 0.01, 0.4, 0.09, 4096]]}
    merge.add([("cluster-1", gpus), ("run-4", steps)])
    sent = merge.take()
    before = copy.deepcopy(sent)
    merge.add([("cluster-1", {**gpus, "gpus": [["node-000", 0, 2.0, 60.0]]}), ("run-4", steps)])
    merge.take()
    assert sent == before
