"""Kernel log lines that matter for GPUs: Xid errors and "GPU has fallen off the bus".

NVML's event API reports Xids too, but not on every driver, container or GPU, and a GPU that fell off the bus
is no longer there to ask; the kernel log always has the line. Where the log comes from, in order:

1. ``path``, when given: a file or FIFO (tests; or a node that forwards its kernel log to a file);
2. ``/dev/kmsg``, opened non-blocking and positioned at the end, so only what happens from now on is read
   (each ``read()`` returns exactly one record: ``"prio,seq,usec_since_boot,flags;message"``);
3. ``journalctl -k -f -o short-unix -n 0`` as a child process, where ``/dev/kmsg`` is not readable (containers
   without CAP_SYSLOG often still see the journal).

Each line goes through :func:`collectors.xid.parse_kmsg_line` (shared with the log doctor), which turns the lines
that matter into wire ``Event`` dicts; this module only finds lines and their time.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from collectors.agent.source import Collected

log = logging.getLogger(__name__)

DEFAULT_JOURNAL_CMD: tuple[str, ...] = ("journalctl", "-k", "-f", "-o", "short-unix", "-n", "0", "-q")
_CHUNK = 65536
_MAX_LINE = 8192  # a longer "line" is junk; kept bounded so a runaway writer cannot grow the buffer
_UNIX_TS = re.compile(r"^(\d{9,11}\.\d+)\s")  # journalctl -o short-unix
_DMESG_T = re.compile(r"^\[(\w{3} \w{3} +\d{1,2} \d\d:\d\d:\d\d \d{4})\]")  # dmesg -T (local time)

Line = tuple[str, float | None]  # a log line and its Unix time when the line says


def line_time(line: str) -> float | None:
    """The Unix time a text log line carries (journalctl short-unix, dmesg -T); None when it carries none."""
    m = _UNIX_TS.match(line)
    if m:
        return float(m.group(1))
    m = _DMESG_T.match(line)
    if m:
        try:
            return time.mktime(time.strptime(m.group(1), "%a %b %d %H:%M:%S %Y"))
        except (ValueError, OverflowError):
            return None
    return None


class _KmsgReader:
    """/dev/kmsg: one record per read; EPIPE means the ring buffer overwrote records we had not read."""

    def __init__(self, device: str) -> None:
        self.fd = os.open(device, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.overrun = 0

    def read(self, max_lines: int) -> list[Line]:
        lines: list[Line] = []
        while len(lines) < max_lines:
            try:
                record = os.read(self.fd, _MAX_LINE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self.overrun += 1  # the next read resumes at the oldest record still in the ring
                continue
            except OSError as exc:
                log.warning("kmsg: reading the kernel log failed: %s", exc)
                break
            if not record:
                break
            lines.append(self._parse(record))
        return lines

    @staticmethod
    def _parse(record: bytes) -> Line:
        text = record.decode("utf-8", "replace")
        header, _, message = text.partition(";")
        message = message.split("\n", 1)[0]  # continuation lines (" SUBSYSTEM=pci") follow the message
        fields = header.split(",")
        if len(fields) >= 3 and fields[2].isdigit():
            # usec since boot on the kernel's clock, which runs with CLOCK_MONOTONIC.
            age = max(0.0, time.monotonic() - int(fields[2]) / 1e6)
            return message, time.time() - age
        return message, None

    def close(self) -> None:
        os.close(self.fd)


class _StreamReader:
    """Newline-delimited text from a non-blocking fd (a file, a FIFO or a child's stdout); partial lines kept."""

    def __init__(self, fd: int, proc: subprocess.Popen[bytes] | None = None) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.proc = proc
        self.buffer = b""
        self.pending: list[bytes] = []
        self.overrun = 0

    def read(self, max_lines: int) -> list[Line]:
        if self.proc is not None and self.proc.poll() is not None and not self.buffer:
            log.warning("kmsg: %s exited with %s; no more kernel log lines", self.proc.args[0], self.proc.returncode)
            self.proc = None  # said once; the fd reads as end of file from now on
        while len(self.pending) < max_lines:
            try:
                chunk = os.read(self.fd, _CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break  # end of file, or a FIFO without writer: more may come next interval
            *complete, self.buffer = (self.buffer + chunk).split(b"\n")
            self.pending.extend(complete)
            if len(self.buffer) > _MAX_LINE:
                self.buffer = b""
        # Lines past the bound wait for the next interval, already split.
        taken, self.pending = self.pending[:max_lines], self.pending[max_lines:]
        return [(raw.decode("utf-8", "replace"), None) for raw in taken]  # time looked up for hits only

    def close(self) -> None:
        os.close(self.fd)
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class KmsgSource:
    """Xid and fallen-off-the-bus lines from the kernel log as wire ``Event`` records (``kind="xid"``).

    Options (the ``[sources.kmsg]`` table of agent.toml):

    * ``path`` (``None``): read this file or FIFO instead of the kernel log.
    * ``from_start`` (``False``): with ``path``, read what the file already holds too (else only new lines).
    * ``device`` (``"/dev/kmsg"``): the kernel log device.
    * ``journal_cmd`` (``journalctl -k -f -o short-unix -n 0 -q``): the fallback when the device is not readable;
      ``[]`` turns the fallback off.
    * ``max_lines`` (``5000``): lines read per interval at most; the rest waits for the next interval (an Xid storm
      must not stall the agent). Records the kernel overwrote before we read them are counted in
      ``dropped["kmsg_overrun"]``.
    """

    name = "kmsg"

    def __init__(self, *, path: str | None = None, from_start: bool = False, device: str = "/dev/kmsg",
                 journal_cmd: list[str] | tuple[str, ...] = DEFAULT_JOURNAL_CMD, max_lines: int = 5000) -> None:
        self.path = path
        self.from_start = from_start
        self.device = device
        self.journal_cmd = list(journal_cmd)
        self.max_lines = max_lines
        self.origin = ""  # what is being read, for the startup summary and the tests
        self._reader: _KmsgReader | _StreamReader | None = None
        self._parse: Callable[[str], dict[str, Any] | None] | None = None
        self._reported_overrun = 0

    def start(self) -> str | None:
        from collectors.xid import parse_kmsg_line  # lazy: the agent starts even if the table fails to import

        self._parse = parse_kmsg_line
        if self.path:
            return self._open_path()
        try:
            self._reader = _KmsgReader(self.device)
            self.origin = self.device
            return None
        except OSError as exc:
            why = f"cannot read {self.device}: {exc.strerror}"
        return self._open_journal(why)

    def collect(self, now: float, out: Collected) -> None:
        if self._reader is None or self._parse is None:
            return
        for line, ts in self._reader.read(self.max_lines):
            event = self._parse(line)
            if event is not None:
                ts = ts if ts is not None else line_time(line)
                event["ts"] = ts if ts is not None and 0 < ts <= now + 60 else now
                out.events.append(event)
        lost = self._reader.overrun - self._reported_overrun
        if lost:
            out.dropped["kmsg_overrun"] = out.dropped.get("kmsg_overrun", 0) + lost
            self._reported_overrun = self._reader.overrun

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _open_path(self) -> str | None:
        assert self.path
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, writer or not
        except OSError as exc:
            return f"cannot read {self.path}: {exc.strerror}"
        if not self.from_start:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError as exc:
                if exc.errno != errno.ESPIPE:  # a FIFO cannot seek, and has no past to skip
                    raise
        self._reader = _StreamReader(fd)
        self.origin = self.path
        return None

    def _open_journal(self, why: str) -> str | None:
        if not self.journal_cmd:
            return why
        exe = shutil.which(self.journal_cmd[0])
        if exe is None:
            return f"{why}; and {self.journal_cmd[0]} is not installed"
        # stderr to a file, not a pipe: nobody drains a pipe while it runs, and a full one would stall it.
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen([exe, *self.journal_cmd[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=errors)
            assert proc.stdout is not None
            try:
                # One that cannot read the journal says so and exits at once; one that works keeps running.
                proc.wait(0.3)
            except subprocess.TimeoutExpired:
                fd = os.dup(proc.stdout.fileno())  # the reader owns its fd; the file object is closed here
                proc.stdout.close()
                self._reader = _StreamReader(fd, proc)
                self.origin = " ".join(self.journal_cmd)
                return None
            proc.stdout.close()
            errors.seek(0)
            err = errors.read(400).decode("utf-8", "replace").strip()
        return f"{why}; and {self.journal_cmd[0]} exited with {proc.returncode}: {err[:200]}"
