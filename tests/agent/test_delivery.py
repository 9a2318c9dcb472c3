"""Delivery without loss: the agent process against a real receiver that goes away, refuses, or outlives a kill -9."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from agent_support import TOKEN, Receiver, free_port, start_agent, wait_for

from collectors.agent.delivery import AUTH_RETRY_S, Backoff, Poster, Sender
from collectors.agent.spool import Spool


def assert_in_order_once(receiver: Receiver, expected_first: int) -> list[int]:
    seqs = receiver.seqs()
    assert seqs == list(range(expected_first, expected_first + len(seqs))), seqs
    assert not receiver.duplicates
    return seqs


def test_batches_spooled_while_the_server_is_down_arrive_once_in_order(standin: Path, tmp_path: Path) -> None:
    port = free_port()
    agent = start_agent(tmp_path, f"http://127.0.0.1:{port}", lib_dir=standin, interval=0.1)
    receiver = None
    try:
        spooled = wait_for(lambda: len(seqs := agent.spooled_seqs()) >= 8 and seqs, what="eight spooled batches")
        receiver = Receiver(port=port)
        wait_for(lambda: len(receiver.seqs()) >= len(spooled) + 5, what="the backlog and five new batches")
    finally:
        agent.stop()
        if receiver:
            receiver.stop()
    seqs = assert_in_order_once(receiver, spooled[0])
    assert set(spooled) <= set(seqs)
    assert "cannot deliver batch" in agent.log() and "server reachable again" in agent.log()


def test_a_batch_refused_with_400_is_dropped_counted_and_logged(standin: Path, tmp_path: Path) -> None:
    refused: list[int] = []

    def respond(batch: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        if not refused or batch["seq"] == refused[0]:
            refused.append(batch["seq"])
            return 400, {"error": "invalid", "detail": "gpus[0].power_w: must be <= 10000, got 12000.0"}
        return None

    receiver = Receiver(respond=respond)
    agent = start_agent(tmp_path, receiver.url, lib_dir=standin, interval=0.1)
    try:
        wait_for(lambda: len(receiver.seqs()) >= 6, what="six accepted batches after the refusal")
    finally:
        agent.stop()
        receiver.stop()
    assert len(refused) == 1  # posted once, never retried
    assert receiver.posts.count(refused[0]) == 1
    assert_in_order_once(receiver, refused[0] + 1)
    reported = [b["dropped"] for b in receiver.accepted if b["dropped"]]
    assert reported == [{"server_rejected": 1}]
    log = agent.log()
    assert log.count(f"server rejected batch {refused[0]} with 400 (invalid: gpus[0].power_w: must be <= 10000") == 1


def test_kill_9_loses_nothing_that_was_spooled(standin: Path, tmp_path: Path) -> None:
    port = free_port()
    spool = tmp_path / "spool.sqlite3"
    first = start_agent(tmp_path, f"http://127.0.0.1:{port}", lib_dir=standin, interval=0.1, spool=spool, name="a")
    try:
        wait_for(lambda: len(first.spooled_seqs()) >= 6, what="six spooled batches")
    finally:
        first.kill9()
    spooled = first.spooled_seqs()
    receiver = Receiver(port=port)
    second = start_agent(tmp_path, receiver.url, lib_dir=standin, interval=0.1, spool=spool, name="b")
    try:
        wait_for(lambda: len(receiver.seqs()) >= len(spooled) + 4, what="the killed agent's batches and new ones")
    finally:
        second.stop()
        receiver.stop()
    # The restarted agent delivers the killed one's batches first, then continues the same numbering.
    seqs = assert_in_order_once(receiver, spooled[0])
    assert seqs[: len(spooled)] == spooled
    assert not second.spooled_seqs()  # a clean stop leaves nothing behind when the server is up


def test_a_refused_token_keeps_batches_and_rereads_the_token_file(tmp_path: Path) -> None:
    receiver = Receiver()
    token = tmp_path / "token"
    token.write_text("revoked-token\n")
    spool = Spool(tmp_path / "spool.sqlite3")
    from collectors.agent.config import read_token

    poster = Poster(receiver.url, lambda: read_token(str(token)), timeout=2)
    sender = Sender(spool, poster, Backoff(0.05, 0.3))
    try:
        seq = spool.put({"v": 1, "agent_id": "n1", "host": "n1", "sent_at": 1.0})
        assert sender.deliver(spool.oldest()) == AUTH_RETRY_S
        assert spool.depth == 1 and not receiver.accepted  # kept: a token problem is not the batch's fault
        token.write_text(TOKEN + "\n")  # the admin fixes the token file
        assert sender.deliver(spool.oldest()) == 0
        assert receiver.seqs() == [seq] and spool.depth == 0
    finally:
        poster.close()
        spool.close()
        receiver.stop()


def test_a_full_spool_drops_the_oldest_and_reports_how_many(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.sqlite3", max_batches=10)
    head = {"v": 1, "agent_id": "n1", "host": "n1", "sent_at": 1.0}
    seqs = [spool.put(head) for _ in range(15)]
    assert spool.depth == 10 and spool.oldest().seq == seqs[5]
    report = spool.put(head, {"hook_buffer_full": 3})
    spool.close()
    reopened = Spool(tmp_path / "spool.sqlite3", max_batches=10)
    rows = []
    while (item := reopened.oldest()) is not None:
        rows.append(json.loads(gzip.decompress(item.body)))
        reopened.delete(item.seq)
    assert [r["seq"] for r in rows] == [*seqs[6:], report]
    assert rows[-1]["dropped"] == {"spool_overflow": 1, "hook_buffer_full": 3}
    # Every eviction is reported exactly once: in a spooled batch, or pending for the next one.
    reported = sum((r["dropped"] or {}).get("spool_overflow", 0) for r in rows if "dropped" in r)
    assert reported + reopened.pending_drops()["spool_overflow"] == 6
    assert reopened.put(head) == report + 1  # numbering survives a restart
    reopened.close()
