"""Party 2 of the ProcessTurns tests, in a module a spawned child imports without Django being set up (the test
module itself imports the app's models)."""

from __future__ import annotations

import os
import time
from typing import Any

from dashboard.storage.sqlite.base import ProcessTurns


def hold_then_ask_again(turns: ProcessTurns, holding: Any, log: Any) -> None:
    """Party 2: take the turn, say so, hold it 0.3 s, hand it on, and at once ask for it again."""
    assert turns.acquire(2, 10)
    holding.set()
    time.sleep(0.3)
    turns.release(2)
    asked = time.monotonic()
    assert turns.acquire(2, 10)
    log.put(("again", time.monotonic() - asked))
    turns.release(2)


def take_and_die(turns: ProcessTurns, holding: Any) -> None:
    assert turns.acquire(2, 10)
    holding.set()
    os._exit(0)  # never released: a writer killed inside its transaction
