"""NCCL debug logs: tail the files a glob matches and keep the lines worth keeping as wire events.

Have each training process write its own NCCL log, named by host and pid, where the agent can read it::

    NCCL_DEBUG=INFO NCCL_DEBUG_FILE=/var/log/nccl/nccl.%h.%p.log torchrun ...

(NCCL expands ``%h`` to the host name and ``%p`` to the pid.) The agent's default glob,
``/var/log/nccl/nccl.*.log``, then matches every process's file. One file is one process, so each file gets its
own :class:`collectors.doctor.nccl.NcclStreamParser` (which de-duplicates per process).

Tailing rules, in the order they are checked every interval:

* a path whose inode changed was rotated: what is left in the old file is read through the descriptor still held,
  then the new file is read from its start (with a new parser: a new file is usually a new process);
* a file shorter than the read position was truncated (``copytruncate``): read again from its start;
* a path that disappeared is read to its end and forgotten; new paths are picked up at the next glob;
* a rotated file that reappears under a name the glob also matches is recognised by its inode and not re-read.

Reads are bounded per interval (``max_bytes``); the rest is read next time. A line without its newline yet is
kept until it is complete; NUL bytes and undecodable bytes (a crashed writer, a binary file matched by mistake)
are dropped or replaced, and over-long lines are cut, so junk cannot break the wire record.
"""

from __future__ import annotations

import glob as globmod
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collectors.agent.source import Collected

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_MAX_LINE = 4096  # longer lines are cut before parsing; NCCL lines are a few hundred bytes
_MAX_PARTIAL = 65536  # a "line" this long without a newline is junk: dropped
_MAX_RETIRED = 1024

Feed = Callable[[str], list[dict[str, Any]]]


@dataclass
class _Tail:
    path: str
    fd: int
    ino: tuple[int, int]  # (st_dev, st_ino)
    offset: int
    feed: Feed
    partial: bytes = b""


class NcclLogSource:
    """NCCL log lines as wire ``Event`` records (``kind="nccl"``, ``data.file`` = the log file).

    Options (the ``[sources.nccl]`` table of agent.toml):

    * ``glob`` (``"/var/log/nccl/nccl.*.log"``): the files to tail; a list of globs is accepted too.
    * ``from_start`` (``False``): read files that exist when the agent starts from their beginning (else only
      what is written from then on; files that appear later are always read from their beginning).
    * ``max_bytes`` (``8 MiB``): bytes read per interval over all files; the rest waits for the next interval.
    * ``max_files`` (``256``): files tailed at once (the most recently written win).
    * ``max_events`` (``2000``): events per interval; more are counted in ``dropped["nccl_events"]``.
    * ``rescan_s`` (``2.0``): how often the glob is evaluated for new files.
    """

    name = "nccl"

    def __init__(self, *, glob: str | list[str] = "/var/log/nccl/nccl.*.log", from_start: bool = False,
                 max_bytes: int = 8 << 20, max_files: int = 256, max_events: int = 2000,
                 rescan_s: float = 2.0) -> None:
        self.globs = [glob] if isinstance(glob, str) else list(glob)
        self.from_start = from_start
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.max_events = max_events
        self.rescan_s = rescan_s
        self._tails: dict[str, _Tail] = {}
        self._retired: dict[tuple[int, int], tuple[int, float]] = {}  # renamed away: inode -> (how far, when)
        self._retired_ttl = max(10.0, 3 * rescan_s)
        self._parser_cls: Callable[[], Any] | None = None
        self._scanned_at = -math.inf

    def start(self) -> str | None:
        try:
            from collectors.doctor.nccl import NcclStreamParser
        except ImportError as exc:
            return f"the NCCL log parser is not available ({exc})"
        self._parser_cls = NcclStreamParser
        self._scan(initial=True)
        return None

    def collect(self, now: float, out: Collected) -> None:
        if self._parser_cls is None:
            return
        if time.monotonic() - self._scanned_at >= self.rescan_s:
            self._scan(initial=False)
        budget = self.max_bytes
        events: list[dict[str, Any]] = []
        for path in list(self._tails):
            budget -= self._follow(self._tails[path], budget, events)
        for event in events[: self.max_events]:
            event["ts"] = now
            out.events.append(event)
        if len(events) > self.max_events:
            out.dropped["nccl_events"] = out.dropped.get("nccl_events", 0) + len(events) - self.max_events

    def close(self) -> None:
        for tail in self._tails.values():
            os.close(tail.fd)
        self._tails.clear()

    # -- discovery ------------------------------------------------------------------------------------------------

    def _scan(self, initial: bool) -> None:
        found: set[str] = set()
        for pattern in self.globs:
            found.update(globmod.glob(pattern))
        self._scanned_at = time.monotonic()
        new = sorted(found - self._tails.keys(), key=_mtime, reverse=True)
        for path in new[: max(0, self.max_files - len(self._tails))]:
            self._open(path, at_end=initial and not self.from_start)

    def _open(self, path: str, at_end: bool) -> _Tail | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            st = os.fstat(fd)
        except OSError as exc:
            log.debug("nccl: cannot open %s: %s", path, exc)
            return None
        ino = (st.st_dev, st.st_ino)
        held = next((t for t in self._tails.values() if t.ino == ino), None)
        if held is not None:
            os.close(fd)
            return self._renamed(held, path)
        offset = st.st_size if at_end else 0
        retired = self._retired.pop(ino, None)
        # A file we read under another name until just now (rotated into the glob) continues where we were. Only
        # just now: inode numbers are reused, and an old entry could make us skip the start of a new file.
        if retired is not None and time.monotonic() - retired[1] <= self._retired_ttl and retired[0] <= st.st_size:
            offset = retired[0]
        assert self._parser_cls is not None
        tail = _Tail(path, fd, ino, offset, self._parser_cls().feed)
        self._tails[path] = tail
        return tail

    def _renamed(self, tail: _Tail, path: str) -> _Tail | None:
        """A file we tail showed up under a second name: renamed (follow it there) or hard-linked (ignore)."""
        try:
            st = os.stat(tail.path)
            if (st.st_dev, st.st_ino) == tail.ino:
                return None  # the same file under two names: read once, under the first
        except OSError:
            pass
        del self._tails[tail.path]
        tail.path = path
        self._tails[path] = tail
        return tail

    def _retire(self, tail: _Tail) -> None:
        try:
            renamed = os.fstat(tail.fd).st_nlink > 0  # still has a name somewhere; 0 means deleted
        except OSError:
            renamed = False
        os.close(tail.fd)
        del self._tails[tail.path]
        if not renamed:
            return
        if len(self._retired) >= _MAX_RETIRED:
            self._retired.pop(next(iter(self._retired)))
        self._retired[tail.ino] = (tail.offset, time.monotonic())

    # -- reading --------------------------------------------------------------------------------------------------

    def _follow(self, tail: _Tail, budget: int, events: list[dict[str, Any]]) -> int:
        """Read what is new in one file (following rotation and truncation); returns the bytes read."""
        try:
            st = os.stat(tail.path)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != tail.ino:
            used = self._read(tail, budget, events, final=True)  # the rest of the old file, through our fd
            self._retire(tail)
            if st is None:
                return used
            fresh = self._open(tail.path, at_end=False)
            return used + (self._read(fresh, budget - used, events) if fresh else 0)
        if st.st_size < tail.offset:
            tail.offset = 0
            tail.partial = b""
        return self._read(tail, budget, events)

    def _read(self, tail: _Tail, budget: int, events: list[dict[str, Any]], final: bool = False) -> int:
        used = 0
        while used < budget:
            try:
                chunk = os.pread(tail.fd, min(_CHUNK, budget - used), tail.offset)
            except OSError:
                break
            if not chunk:
                break
            tail.offset += len(chunk)
            used += len(chunk)
            self._lines(tail, chunk, events)
        if final and tail.partial:
            self._lines(tail, b"\n", events)  # the writer is gone: its last line will not be completed
        return used

    def _lines(self, tail: _Tail, chunk: bytes, events: list[dict[str, Any]]) -> None:
        data = tail.partial + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            tail.partial = data if len(data) <= _MAX_PARTIAL else b""
            return
        tail.partial = data[cut + 1:]
        if len(tail.partial) > _MAX_PARTIAL:
            tail.partial = b""
        text = data[:cut].decode("utf-8", "replace")
        if "\x00" in text:
            text = text.replace("\x00", "")
        label = tail.path[-1024:]
        for line in text.split("\n"):
            for event in tail.feed(line[:_MAX_LINE]):
                event["data"] = {**(event.get("data") or {}), "file": label}
                events.append(event)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
