"""Reading messy log text: bounded-memory line streaming and the cleaning every parser shares.

Real pasted logs arrive with ANSI colours, CRLF endings, NUL bytes, invalid UTF-8 and lines cut at either end.
Everything here is defensive and cheap: the common clean line costs two ``in`` checks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

# Every line is cut to this before any parser matches it. Real log lines are a few hundred bytes (the kernel and
# NCCL print at most ~1 KB), so nothing we parse is lost; it bounds what one line can cost every regex, what a kept
# warning holds, and keeps every digit run under int()'s 4300-digit limit. Hostile input must not get more.
MAX_LINE = 4096
CHUNK = 1 << 20

_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_line(line: str) -> str:
    """Strip colours, carriage returns and control bytes; keep everything else verbatim."""
    if line.isprintable():
        return line
    if "\x1b" in line:
        line = _ANSI_RE.sub("", line)
    if "\r" in line:
        line = line.rstrip("\r")
    if "\r" in line:
        # A progress bar rewrites the line with CRs; what the terminal finally showed is the last segment,
        # but a log line glued after a bar is what we want, so keep the last non-empty part.
        parts = [p for p in line.split("\r") if p.strip()]
        line = parts[-1] if parts else ""
    if _CONTROL_RE.search(line):
        line = _CONTROL_RE.sub("", line)
    return line


def sanitize(text: str, limit: int = 1024) -> str:
    """A bounded, printable one-line copy of ``text`` for messages that leave the process."""
    text = clean_line(text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split_chunks(chunks: Iterable[bytes | str]) -> Iterator[str]:
    """Lines from a stream of chunks; memory stays at one chunk plus MAX_LINE whatever the input."""
    pending: list[str] = []
    pending_len = 0
    utf8 = _Utf8()
    for chunk in chunks:
        text = utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        if not text:
            continue
        pieces = text.split("\n")
        if len(pieces) == 1:
            if pending_len < MAX_LINE:
                pending.append(pieces[0])
                pending_len += len(pieces[0])
            continue
        first = pieces[0]
        if pending:
            pending.append(first)
            first = "".join(pending)
            pending, pending_len = [], 0
        yield first[:MAX_LINE]
        for piece in pieces[1:-1]:
            yield piece if len(piece) <= MAX_LINE else piece[:MAX_LINE]
        last = pieces[-1]
        if last:
            pending, pending_len = [last[:MAX_LINE]], min(len(last), MAX_LINE)
    tail = utf8.flush()
    if tail:
        pending.append(tail)
    if pending:
        yield "".join(pending)[:MAX_LINE]


class _Utf8:
    """UTF-8 decoding across chunk boundaries; invalid bytes become U+FFFD instead of raising."""

    def __init__(self) -> None:
        import codecs

        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, data: bytes) -> str:
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _read_chunks(stream: IO[Any]) -> Iterator[bytes | str]:
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            return
        yield chunk


Source = str | bytes | os.PathLike[str] | IO[Any]


def iter_source_lines(source: Source) -> Iterator[str]:
    """Lines of one source: ``str``/``bytes`` is log text, a path-like is a file, anything with ``read`` is a stream."""
    if isinstance(source, (str, bytes)):
        yield from _split_chunks(source[i : i + CHUNK] for i in range(0, len(source), CHUNK))
    elif isinstance(source, os.PathLike):
        with Path(source).open("rb") as fh:
            yield from _split_chunks(_read_chunks(fh))
    else:
        yield from _split_chunks(_read_chunks(source))
