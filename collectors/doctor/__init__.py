"""The log doctor: NCCL, kernel Xid, nvidia-smi, torch.distributed and InfiniBand text -> facts and a verdict.

``diagnose(sources, kind=None)`` reads any number of sources (several ranks' logs of one job are merged) in one
streaming pass with bounded memory and returns a :class:`Report`. A source is log text (``str``), a path
(``pathlib.Path`` or any ``os.PathLike``) or a stream with ``read`` (text or bytes). Nothing here imports Django.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, Protocol

from collectors.doctor.ib import IbFacts
from collectors.doctor.kmsg import XidFacts
from collectors.doctor.nccl import NcclFacts, NcclStreamParser, parse_record
from collectors.doctor.report import HEALTHY, Finding, Report
from collectors.doctor.smi import SmiFacts
from collectors.doctor.text import MAX_LINE, Source, clean_line, iter_source_lines
from collectors.doctor.torchdist import TorchFacts

__all__ = ["KINDS", "NcclStreamParser", "Report", "detect_kind", "diagnose"]

KINDS = ("nccl", "torch", "xid", "nvidia-smi", "ib")
HEAD_BYTES = 64 * 1024

_SMI = ("<nvidia_smi_log", "NVSMI LOG")
_SMI_KEYS = ("Retired Pages", "Remapped Rows", "Clocks Throttle Reasons", "Clocks Event Reasons", "ECC Errors",
             "Pending Page Blacklist", "Power Readings", "Ecc Mode", "Product Name", "<gpu id=",
             "HW Power Brake Slowdown", "HW Thermal Slowdown", "SW Thermal Slowdown")
_SMI_GPU_RE = re.compile(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\s*$", re.M)
_IB = ("CA '", "hca_id:", "# Port counters", "# Port extended counters", "Errors for ", "/sys/class/infiniband/",
       "Physical state:", "phys_port_cnt", "SymbolErrorCounter")
_TORCH = ("Watchdog caught", "DistBackendError", "DistStoreError", "DistNetworkError", "NCCL error",
          "ChildFailedError", "ProcessGroupNCCL.cpp", "Heartbeat monitor timed out", "store_based_barrier",
          "Root Cause (first observed failure)", "(local_rank: ")
_NCCL = (" NCCL INFO ", " NCCL WARN ", "NCCL version ")
# Bounded and anchored at a word start so a 64 KB line of junk costs linear time, not quadratic.
_OLD_NCCL_RE = re.compile(r"(?<![\w.-])[\w.-]{1,100}:\d{1,10}:\d{1,10} \[\d{1,4}\] (?:INFO|WARN) ")
_XID = ("NVRM: Xid", "has fallen off the bus", "NVRM: fallen off the bus")
# ibqueryerrors prints one line per port: " GUID 0x... port ALL: [LinkDownedCounter == 25 (25.000)] ..."
_QERR_RE = re.compile(r"GUID 0x[0-9a-fA-F]{1,16} port \w{1,8}: \[\w{1,64} == \d")


def detect_kind(sample: str) -> str:
    """The most likely kind of a text sample (its first few tens of KB): one of KINDS, or "unknown"."""
    if any(m in sample for m in _SMI) or (_SMI_GPU_RE.search(sample) and "Product Name" in sample) or \
            sum(m in sample for m in _SMI_KEYS) >= 2:
        return "nvidia-smi"
    nccl = sum(sample.count(m) for m in _NCCL) + len(_OLD_NCCL_RE.findall(sample))
    xid = sum(sample.count(m) for m in _XID)
    if any(m in sample for m in _TORCH):
        return "torch"
    if (sum(sample.count(m) for m in _IB) >= 2 or _QERR_RE.search(sample)) and nccl == 0:
        return "ib"
    if xid and xid >= nccl:
        return "xid"
    if nccl:
        return "nccl"
    return "unknown"


class _Analyzer(Protocol):
    def feed(self, line: str) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...

    def findings(self) -> list[Finding]: ...


def diagnose(sources: Source | Iterable[Source], kind: str | None = None) -> Report:
    """Read every source once and explain it. ``kind`` forces a parser (one of KINDS); ``None`` detects it."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if isinstance(sources, (str, bytes)) or hasattr(sources, "read") or hasattr(sources, "__fspath__"):
        sources = [sources]  # type: ignore[list-item]
    heads, streams = _heads(list(sources))  # type: ignore[arg-type]
    detected = detect_kind("\n".join(chain.from_iterable(heads)))
    lines = chain.from_iterable(chain(h, s) for h, s in zip(heads, streams, strict=True))
    chosen = kind or detected
    if chosen in ("nvidia-smi", "ib"):
        return _single(chosen, SmiFacts() if chosen == "nvidia-smi" else IbFacts(), lines)
    width = _wrap_width(chain.from_iterable(heads))
    return _job(kind, detected, _unwrap(lines, width) if width else lines)


def _heads(sources: list[Source]) -> tuple[list[list[str]], list[Iterator[str]]]:
    """The first HEAD_BYTES of each source (for detection), and each source's remaining lines."""
    heads, rests = [], []
    for source in sources:
        it = iter_source_lines(source)
        head, size = [], 0
        for line in it:
            head.append(line if line.isprintable() else clean_line(line))
            size += len(line) + 1
            if size >= HEAD_BYTES:
                break
        heads.append(head)
        rests.append(it)
    return heads, rests


def _wrap_width(lines: Iterable[str]) -> int | None:
    """A terminal's hard-wrap width: many lines exactly W long and none longer. None when the text is not wrapped.
    Lines cut at MAX_LINE are not a terminal's doing and are left out."""
    lengths = Counter(len(line) for line in lines if line and len(line) < MAX_LINE)
    if not lengths:
        return None
    longest = max(lengths)
    total = sum(lengths.values())
    if longest >= 60 and lengths[longest] >= 3 and lengths[longest] * 20 >= total:
        return longest
    return None


# Lines that begin a record of their own even right after a full-width line.
_RECORD_STARTS = ("Traceback", "[rank", "[E", "[W", "[I", "NCCL version", "  File ")


def _unwrap(lines: Iterable[str], width: int) -> Iterator[str]:
    """Join a line cut at ``width`` with its continuation (a line that does not start a record of its own).

    A joined line stops growing at MAX_LINE: text made only of full-width lines would otherwise become one line of
    the whole upload. Later continuations are still swallowed (they belong to the record), just not kept."""
    prev: str | None = None
    seg = 0
    for line in lines:
        if prev is not None and seg == width and line and not line.startswith(_RECORD_STARTS) \
                and parse_record(line) is None:
            if len(prev) < MAX_LINE:
                prev += line[: MAX_LINE - len(prev)]
            seg = len(line)
            continue
        if prev is not None:
            yield prev
        prev, seg = line, len(line)
    if prev is not None:
        yield prev


def _single(kind: str, analyzer: _Analyzer, lines: Iterable[str]) -> Report:
    total = unparsed = 0
    for line in lines:
        line = clean_line(line)
        if not line.strip():
            continue
        total += 1
        if not analyzer.feed(line):
            unparsed += 1
    return _report(kind, analyzer.to_dict(), analyzer.findings(), total, unparsed)


def _job(kind: str | None, detected: str, lines: Iterable[str]) -> Report:
    """NCCL, torch and kernel lines interleave in a job's output; all three read every line, the kind decides
    which facts are shown, and the verdict weighs everything found."""
    nccl, torch, xid = NcclFacts(), TorchFacts(), XidFacts()
    total = unparsed = 0
    nccl_feed, torch_feed, xid_feed = nccl.feed, torch.feed, xid.feed
    for line in lines:
        if not line.isprintable():
            line = clean_line(line)
        if not line or line.isspace():
            continue
        total += 1
        if nccl_feed(line):
            # torch's own error lines quote "NCCL version x.y"; they are torch's facts too.
            if "NCCL error" in line or "WorkNCCL" in line:
                torch_feed(line)
            continue
        if not torch_feed(line) and not xid_feed(line):
            unparsed += 1
    chosen = kind or _job_kind(detected, nccl, torch, xid)
    findings = nccl.findings() + torch.findings(nccl.nranks) + xid.findings()
    if chosen == "torch":
        facts = torch.to_dict(sorted(nccl.hosts))
    elif chosen == "xid":
        facts = xid.to_dict()
    elif chosen == "nccl":
        facts = nccl.to_dict()
    else:
        facts = {}
    return _report(chosen, facts, findings, total, unparsed)


def _job_kind(detected: str, nccl: NcclFacts, torch: TorchFacts, xid: XidFacts) -> str:
    if torch.error_class not in (None, "other") or (torch.errors and not nccl.records):
        return "torch"
    if (xid.events or xid.off_bus) and (detected == "xid" or not nccl.records):
        return "xid"
    if nccl.records:
        return "nccl"
    return detected if detected in ("torch", "xid", "nccl") and (torch.recognized or xid.events) else "unknown"


def _report(kind: str, facts: dict[str, Any], findings: list[Finding], total: int, unparsed: int) -> Report:
    ranked = sorted(findings, key=lambda f: -f.score)
    if kind == "unknown":
        top = Finding(0, "This text is not a log the doctor knows (NCCL, kernel Xid, nvidia-smi -q, torch.distributed "
                      "or InfiniBand tools)", "paste the raw output of one of those, or pass --kind")
    else:
        top = ranked[0] if ranked else HEALTHY
    return Report(kind=kind, facts=facts, finding=top, unparsed_lines=unparsed, lines=total, others=ranked[1:])
