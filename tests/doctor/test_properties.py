"""No input breaks the doctor: junk never raises or hangs, unknown lines are counted, 100 MB streams bounded."""

from __future__ import annotations

import io
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.doctor import KINDS, diagnose
from collectors.doctor.nccl import NcclStreamParser
from collectors.xid import parse_kmsg_line

FRAGMENTS = st.sampled_from([
    "NCCL INFO ", " NCCL WARN ", "host:1:2 [0] ", "via NET/", "NCCL version ", "nranks ", "NVRM: Xid (PCI:",
    "Watchdog caught collective operation timeout", "WorkNCCL(", "Timeout(ms)=", "<nvidia_smi_log>", "<gpu id=",
    "CA '", "Port 1:", " : ", "\r", "\x1b[31m", "\n", "\t", "GPU 00000000:01:00.0\n", "-> 6", "with status=",
    "set by environment to ", "[rank3]:", "/ports/1/counters/x:", "<!ENTITY a 'b'>", "\x00", "\ufffd",
])
MESSY = st.lists(st.one_of(FRAGMENTS, st.text(max_size=40)), max_size=60).map("".join)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=4000), st.sampled_from((None, *KINDS)))
def test_random_bytes_never_raise(data, kind):
    report = diagnose(io.BytesIO(data), kind=kind)
    assert report.unparsed_lines <= report.lines
    report.to_json()
    report.render_text()


@FAST
@given(MESSY, st.sampled_from((None, *KINDS)))
def test_log_shaped_junk_never_raises(text, kind):
    report = diagnose(text, kind=kind)
    assert 0 <= report.unparsed_lines <= report.lines
    report.render_text()


@FAST
@given(MESSY)
def test_stream_and_kmsg_parsers_never_raise(text):
    parser = NcclStreamParser()
    for line in text.split("\n"):
        for event in parser.feed(line):
            assert len(event["message"]) <= 2000
        parse_kmsg_line(line)


@FAST
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1,
                        max_size=30).filter(lambda s: s.strip() and s.isprintable() and "NCCL" not in s), max_size=30))
def test_unknown_lines_are_counted_not_errors(lines):
    report = diagnose("\n".join(lines) + "\n", kind="nccl")
    assert report.lines == len(lines)
    assert report.unparsed_lines <= len(lines)


def test_a_megabyte_line_and_a_line_without_an_end_are_cut_not_fatal():
    text = "x" * 3_000_000 + "\nhost:1:2 [0] NCCL INFO Using network IB\n" + "y" * 2_000_000
    report = diagnose(text)
    assert report.facts["network"] == "IB"
    assert report.unparsed_lines == 2


class _Junk(io.RawIOBase):
    """100 MB of log-ish junk, produced on demand: a 40 MB line with no newline, then short lines."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.sent = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = min(n if n > 0 else 1 << 20, self.left)
        if n <= 0:
            return b""
        if self.sent < 40_000_000:
            chunk = b"\x01junk" * (n // 5)
        else:
            line = b"\xff\xfe garbage NCCL-ish but not NCCL 12:34:56 [x] " + b"z" * 950 + b"\n"
            chunk = (line * (n // len(line) + 1))[:n]
        self.left -= len(chunk)
        self.sent += len(chunk)
        return chunk or b"\n"


def test_100_mb_streams_in_bounded_memory():
    tracemalloc.start()
    try:
        report = diagnose(_Junk(100_000_000), kind="nccl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.lines > 50_000
    assert report.unparsed_lines == report.lines
    assert peak < 32 * 1024 * 1024, peak
