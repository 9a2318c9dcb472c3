"""torch.distributed failures: watchdog timeouts, NCCL errors, store/rendezvous timeouts, heartbeat monitor.

Covers the ProcessGroupNCCL messages from torch 1.x (``[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught ...``)
to 2.x (``[rank0]:[E321 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 0] ...``), the Python exceptions
(``DistBackendError``, ``DistStoreError``, ``RuntimeError: NCCL error in: ...``) and torchrun's failure table.
"""

from __future__ import annotations

import re
from typing import Any

from collectors.doctor.report import Finding

_MARKERS = ("Watchdog", "watchdog", "ProcessGroupNCCL", "NCCL error", "DistBackendError", "DistStoreError",
            "DistNetworkError", "Timed out", "timed out", "wait timeout", "Heartbeat", "heartbeat", "ChildFailedError",
            "c10d", "exitcode", "host      :", "host :", "rank      :", "ncclSystemError", "ncclInternalError",
            "ncclUnhandledCudaError", "ncclRemoteError", "ncclInvalidUsage", "ncclInvalidArgument", "Last error",
            "CUDA out of memory", "OutOfMemoryError", "torch.distributed", "store_based_barrier", "Socket Timeout",
            "Rank ", "[rank")
# "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)". Only the head is a regex: the
# old "[^)]*?(?:Timeout...)?\)" tail rescanned to the next ")" from every "WorkNCCL(" (quadratic when repeated).
_WORK_RE = re.compile(r"WorkNCCL\((?:SeqNum=(?P<seq>\d+), )?OpType=(?P<op>\w+)")
_WORK_TIMEOUT_RE = re.compile(r"Timeout\(ms\)=(\d+)\)")
_RANK_RES = (re.compile(r"\bRank (\d+)\]"), re.compile(r"\[rank(\d+)\]:"), re.compile(r"\bon rank:? (\d+)"),
             re.compile(r"^\s*rank\s+:\s*(\d+)"))
_TABLE_HOST_RE = re.compile(r"^\s*host\s+:\s*(\S+)")
_NCCL_ERR_RE = re.compile(r"\b(nccl(?:System|Internal|UnhandledCuda|Remote|InvalidUsage|InvalidArgument)Error)\b")
_NCCL_ERROR_IN_RE = re.compile(r"NCCL error(?: in: \S+)?[,:]\s*(?P<what>[^,(]+)")
_STORE_MS_RE = re.compile(r"(?:wait timeout after|timeout after) (\d+)\s*ms|Timed out after (\d+) seconds"
                          r"|timeout=(\d+):(\d\d):(\d\d)|has timed out after (\d+)s")
_EXIT_RE = re.compile(r"exitcode\s*:\s*(-?\d+)")

_STORE = ("DistStoreError", "store_based_barrier", "waiting for clients", "Socket Timeout", "wait timeout after",
          "client socket has timed out", "TCPStore", "rendezvous")
_HEARTBEAT = ("Heartbeat monitor timed out", "watchdog got stuck", "heartbeat monitor", "Heartbeat monitor")
# Rank numbers come from the text: a bigger job than this is a forged or corrupt log, not a reason to build
# range(world_size) (a 2-line paste saying "nranks 99999999999" once froze the doctor) or to keep every number seen.
MAX_RANKS = 1 << 16


def _work(line: str) -> tuple[str, str | None, str | None] | None:
    """(op, seq, timeout ms) of the first "WorkNCCL(...)" that is closed; the timeout only when it ends the args."""
    m = _WORK_RE.search(line)
    if not m:
        return None
    close = line.find(")", m.end())
    if close < 0:
        return None  # no later "WorkNCCL(" can be closed either
    # "Timeout(ms)" holds the first ")" after the head when it is the last argument.
    t = _WORK_TIMEOUT_RE.match(line, close - 10) if close - 10 >= m.end() else None
    return m["op"], m["seq"], t.group(1) if t else None


class TorchFacts:
    """Accumulates one job's torch.distributed errors across ranks (duplicated tracebacks are harmless)."""

    def __init__(self) -> None:
        self.classes: dict[str, None] = {}  # in the order first seen
        self.collective: str | None = None
        self.timeout_ms: int | None = None
        self.seq_num: int | None = None
        self.seq_nums: dict[int, set[int]] = {}
        self.ranks: set[int] = set()
        self.hosts: dict[str, None] = {}
        self.nccl_errors: dict[str, None] = {}
        self.exit_codes: dict[int, None] = {}
        self.evidence: list[str] = []
        self.oom = False
        self.errors = 0
        self.recognized = 0

    def feed(self, line: str) -> bool:
        if not any(m in line for m in _MARKERS):
            return False
        hit = self._classify(line)
        self._details(line, hit)
        hit = hit or self._table(line)
        self.recognized += hit
        return hit

    def _classify(self, line: str) -> bool:
        cls = None
        if "Watchdog caught collective operation timeout" in line or ("WorkNCCL(" in line and "timing out" in line):
            cls = "timeout"
        elif any(h in line for h in _HEARTBEAT):
            cls = "heartbeat_monitor_timeout"
        elif "NCCL error" in line or _NCCL_ERR_RE.search(line):
            cls = "nccl_error"
        elif any(s in line for s in _STORE) and ("imeout" in line or "imed out" in line):
            cls = "store_timeout"
        elif "CUDA out of memory" in line or "OutOfMemoryError" in line:
            self.oom = True
            cls = "other"
        elif ("Error" in line or "[E" in line) and ("torch.distributed" in line or "ProcessGroup" in line
                                                    or "c10d" in line or "ChildFailedError" in line):
            cls = "other"
        if cls is None:
            return False
        self.errors += 1
        if cls not in self.classes:
            self.classes[cls] = None
        if len(self.evidence) < 8 and line.strip() not in self.evidence:
            self.evidence.append(line.strip()[:400])
        return True

    def _details(self, line: str, is_error: bool) -> None:
        if "WorkNCCL(" in line:
            work = _work(line)
            if work:
                op, seq_text, timeout = work
                self.collective = self.collective or op
                if timeout:
                    self.timeout_ms = self.timeout_ms or int(timeout)
                if seq_text:
                    seq = int(seq_text)
                    self.seq_num = self.seq_num if self.seq_num is not None else seq
                    self._rank_seq(line, seq)
        if is_error:
            for rx in _RANK_RES[:3]:
                for r in rx.findall(line):
                    self._rank(int(r))
            if "NCCL error" in line or "nccl" in line:
                self._nccl_error(line)
            if self.timeout_ms is None and ("imeout" in line or "imed out" in line):
                self._store_timeout(line)

    def _rank(self, rank: int) -> None:
        if len(self.ranks) < MAX_RANKS:
            self.ranks.add(rank)

    def _rank_seq(self, line: str, seq: int) -> None:
        m = _RANK_RES[0].search(line) or _RANK_RES[1].search(line)
        if m and (seq in self.seq_nums or len(self.seq_nums) < 64):
            ranks = self.seq_nums.setdefault(seq, set())
            if len(ranks) < MAX_RANKS:
                ranks.add(int(m.group(1)))

    def _nccl_error(self, line: str) -> None:
        m = _NCCL_ERR_RE.search(line)
        if m:
            self.nccl_errors.setdefault(m.group(1), None)
        m = _NCCL_ERROR_IN_RE.search(line)
        if m and m["what"].strip() and len(self.nccl_errors) < 20:
            self.nccl_errors.setdefault(m["what"].strip(), None)

    def _store_timeout(self, line: str) -> None:
        m = _STORE_MS_RE.search(line)
        if not m:
            return
        if m.group(1):
            self.timeout_ms = int(m.group(1))
        elif m.group(2):
            self.timeout_ms = int(m.group(2)) * 1000
        elif m.group(3):
            h, mi, s = (int(m.group(i)) for i in (3, 4, 5))
            self.timeout_ms = ((h * 60 + mi) * 60 + s) * 1000
        elif m.group(6):
            self.timeout_ms = int(m.group(6)) * 1000

    def _table(self, line: str) -> bool:
        """torchrun's ChildFailedError table: host / rank / exitcode rows."""
        m = _TABLE_HOST_RE.match(line)
        if m:
            self.hosts.setdefault(m.group(1), None)
            return True
        m = _RANK_RES[3].match(line)
        if m:
            self._rank(int(m.group(1)))
            return True
        m = _EXIT_RE.search(line)
        if m:
            self.exit_codes.setdefault(int(m.group(1)), None)
            return True
        return "ChildFailedError" in line or "Root Cause" in line

    @property
    def error_class(self) -> str | None:
        return next(iter(self.classes), None)

    def to_dict(self, nccl_hosts: list[str] | None = None) -> dict[str, Any]:
        hosts = dict(self.hosts)
        for h in nccl_hosts or ():
            hosts.setdefault(h, None)
        return {
            "error_class": self.error_class or "other",
            "collective": self.collective,
            "timeout_ms": self.timeout_ms,
            "seq_num": self.seq_num,
            "ranks": sorted(self.ranks),
            "hosts": sorted(hosts),
        }

    def findings(self, world_size: int | None = None) -> list[Finding]:
        out: list[Finding] = []
        ev = tuple(self.evidence[:5])
        if self.oom:
            out.append(Finding(85, "A rank ran out of GPU memory (CUDA out of memory); the others then waited on it",
                               "reduce the batch or sequence length, enable activation checkpointing, or set "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation", ev))
        cls = self.error_class
        if cls == "timeout":
            out.append(self._timeout_finding(world_size, ev))
        elif cls == "heartbeat_monitor_timeout":
            out.append(Finding(75, "The NCCL watchdog itself got stuck (heartbeat monitor): a CUDA or NCCL call "
                               "never returned - often a GPU, driver or NVLink fault, or a rank hung in a kernel",
                               "check dmesg on that node for Xid (79, 94/95, 74, 119), take a py-spy dump of the "
                               "stuck rank; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC only delays the kill", ev))
        elif cls == "nccl_error":
            what = ", ".join(list(self.nccl_errors)[:3]) or "an NCCL error"
            out.append(Finding(70, f"NCCL failed inside torch.distributed ({what})",
                               "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET and read the first NCCL WARN "
                               "across all ranks; 'remote process exited' means look at the other ranks first", ev))
        elif cls == "store_timeout":
            out.append(Finding(75, "Rendezvous/store timed out: not every rank reached the TCPStore "
                               "(MASTER_ADDR:MASTER_PORT) in time",
                               "check every node actually started and has the same world size, that MASTER_ADDR "
                               "resolves and MASTER_PORT is open from all nodes; a rank that crashed before "
                               "init_process_group leaves the others waiting here", ev))
        elif cls == "other":
            out.append(Finding(40, "A torch.distributed error was reported", "read the first error line below; "
                               "the first rank to fail is the cause, the others report the consequence", ev))
        failed = sorted(c for c in self.exit_codes if c not in (0, -9))
        if failed and not out:
            out.append(Finding(40, f"Ranks exited with code {', '.join(map(str, failed))} (torchrun's failure table "
                               "only says that they died, not why)", "scroll up to the first Python traceback of the "
                               "'Root Cause' rank; -6 (SIGABRT) usually follows an NCCL watchdog timeout", ev))
        if -9 in self.exit_codes:
            out.append(Finding(80, "A rank was killed with SIGKILL (exitcode -9): usually the host ran out of "
                               "memory (OOM killer) or the scheduler killed it", "check `dmesg | grep -i oom` on "
                               "that host and the job's memory limit; fewer DataLoader workers", ev))
        return out

    def _timeout_finding(self, world_size: int | None, ev: tuple[str, ...]) -> Finding:
        op = self.collective or "a collective"
        seq = f" (SeqNum {self.seq_num})" if self.seq_num is not None else ""
        after = f" after {self.timeout_ms} ms" if self.timeout_ms else ""
        cause = f"{op}{seq} timed out{after}: at least one rank never joined it"
        if len(self.seq_nums) > 1:
            cause += f"; ranks were at different collectives (SeqNums {', '.join(map(str, sorted(self.seq_nums)))})"
        if world_size and self.ranks and world_size <= MAX_RANKS:
            missing = sorted(set(range(world_size)) - self.ranks)
            if missing and len(missing) <= 16:
                cause += f"; ranks that did not report: {', '.join(map(str, missing))}"
        fix = ("the missing or lagging rank is the one to look at: py-spy dump its stack, check its node's dmesg "
               "(Xid) and IB port; if ranks disagree on the SeqNum the program is desynchronised (a rank skipped or "
               "reordered a collective); raise the timeout only for known-slow steps such as checkpoint saves")
        return Finding(80, cause, fix, ev)
