"""NCCL debug output (``NCCL_DEBUG=INFO``): one line grammar, two consumers.

* :class:`NcclStreamParser` - for the agent tailing live log files: ``feed(line)`` returns wire ``Event`` dicts
  (without ``ts``) for the few lines worth keeping, each kind of fact once.
* :class:`NcclFacts` - for the doctor: accumulates the facts of a whole (multi-rank) log and proposes findings.

A record looks like ``[prefix]host:pid:tid [dev] [file.cc:123 ]NCCL INFO|WARN message``; NCCL before 2.3 printed
``host:pid:tid [dev] INFO message`` (no "NCCL"). The version banner ``NCCL version 2.21.5+cuda12.4`` comes bare or
as an INFO message. Anything can precede the host (``[1,3]<stdout>:``, ``[rank3]:``, timestamps, pdsh ``host: ``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from collectors.doctor.report import Finding
from collectors.doctor.text import clean_line, sanitize

_LEVELS = (" NCCL INFO ", " NCCL WARN ", " INFO ", " WARN ", " NCCL TRACE ", " NCCL ABORT ")
# host:pid:tid [dev] with an optional "file.cc:123" (WARN lines) and optional "NCCL"; anchored at the level.
_HEAD_RE = re.compile(r"(?:^|[\s|>\]:])(?P<host>[^\s:|\[\]]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\]"
                      r"(?: [\w./+-]+:\d+)?(?: NCCL)?$")
_TZ_GLUE_RE = re.compile(r"\d[+-]\d\d:$")
_HOSTLESS_RE = re.compile(r"^(?:\[[^\]\s]{1,40}\](?:<\w{1,8}>)?:?\s?|\d{4}-\d\d-\d\d[T ][\d:.,]{1,20}Z?\s"
                          r"|[\w./+-]{1,60}\.cc:\d{1,6}\s|\s)*(?P<nccl>NCCL) (?P<level>WARN|INFO) ")
_VERSION_RE = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+[\w.+-]*)")
_NRANKS_RE = re.compile(r"\bnranks (\d+)")
_RANK_RE = re.compile(r"\brank (\d+) nranks")
_COMM_RE = re.compile(r"\bcomm (0x[0-9a-fA-F]+)")
_ENV_RE = re.compile(r"^(?P<name>NCCL_\w+|CUDA_\w+) set by environment to (?P<value>.*?)\.?$")
# Trailing blanks are cut with str.rstrip, not "(.+?)\s*$": the lazy form rescans the blanks at every step
# (quadratic in a run of spaces).
_NETWORK_RE = re.compile(r"^Using (?:internal )?[Nn]etwork (?P<net>.+)")
_ERRRET_RE = re.compile(r"^[\w./+-]+:\d+ -> (?P<code>\d+)")
# "Got completion from peer 10.0.0.2<49392> with error 12, opcode 0, len 0, vendor err 129 (Recv)" (<=2.18) and
# "... with status=12 opcode=1 len=0 vendor err 129 (Send) localGid ..." (>=2.19); "from peer" is absent before 2.12.
# The gap before "vendor err" is bounded: ".*?" would scan to the end of the line from every "Got completion".
# A connection NCCL set up: "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", "Channel 00/0 : 8[0] -> 0[0] [receive] via
# NET/Socket/0" (the bracket holds the CUDA device, the bus id in hex since 2.12: "1[2a000]"), "Ring 00 : 7 -> 8 [send]
# via NET/AWS Libfabric/0" (2.4). The sender prints its own rank first; a "[receive]" line prints the peer first.
_CONN_RE = re.compile(r"^(?:Channel|Ring) \d{1,4}(?:/\d{1,4})? ?: +(\d{1,7})(?:\[[0-9a-fA-F]{1,16}\])? -> "
                      r"(\d{1,7})(?:\[[0-9a-fA-F]{1,16}\])?(?: \[(send|receive)\])? via ")
# A communicator's rank and size: "ncclCommInitRank comm 0x.. rank 3 nranks 16 ... Init START" (2.19+, before its
# connections), "comm 0x.. rank 3 nRanks 16 nNodes 2 ...", "comm 0x.. rank 3 nranks 16 ... - Init COMPLETE" (after).
_COMM_RANK_RE = re.compile(r"\brank (\d{1,7}) n[Rr]anks (\d{1,7})")
_IBWC_RE = re.compile(r"Got completion (?:from peer (?P<peer>\S+) )?with (?:error |status=)(?P<status>\d+)"
                      r".{0,200}?vendor err (?P<vendor>\d+)")

# "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB ib0:10.0.0.1<0>" and the grouped form of the IB plugins,
# "[0]={[0] mlx5_2:1/RoCE, [1] mlx5_3:1/RoCE}"; "NET/Socket : Using [0]eth0:10.0.0.1<0> [1]eth1:..."; "Bootstrap :
# Using bond0:10.0.0.1<0>". Names are bounded so a junk line costs linear time.
_IB_DEV_RE = re.compile(r"(?<![\w.-])([\w.-]{1,64}):(\d{1,3})/(IB|RoCE)\b")
_OOB_RE = re.compile(r"\bOOB ([\w.-]{1,64}):")
_SOCK_IF_RE = re.compile(r"\[\d{1,4}\]([\w.-]{1,64}):")
_BOOT_IF_RE = re.compile(r"^Bootstrap ?: Using ([\w.-]{1,64}):")


def net_devices(msg: str) -> tuple[list[str], list[str], str | None] | None:
    """For a "NET/IB : Using ..." message: (["mlx5_0:1", ...], their link layers ["IB"|"RoCE"], the OOB interface)."""
    if not msg.startswith("NET/IB") or "Using" not in msg[:20]:
        return None
    found = _IB_DEV_RE.findall(msg[:4096])
    oob = _OOB_RE.search(msg[:4096])
    return [f"{d}:{p}" for d, p, _ in found], [link for _, _, link in found], oob.group(1) if oob else None


def socket_interfaces(msg: str) -> list[str] | None:
    """The interfaces NCCL chose, from "NET/Socket : Using [0]eth0:..." or "Bootstrap : Using eth0:..."."""
    if (msg.startswith("NET/Socket") or msg.startswith("Bootstrap")) and "Using [" in msg[:24]:
        return _SOCK_IF_RE.findall(msg[:4096])  # a list; NCCL before 2.6 listed every interface for the bootstrap
    m = _BOOT_IF_RE.match(msg)
    return [m.group(1)] if m else None


# ibv_wc_status, from the verbs API: what an IB completion error number means.
IB_WC_STATUS = {
    1: "local length error", 2: "local QP operation error", 3: "local EE context operation error",
    4: "local protection error", 5: "work request flushed", 6: "memory window bind error",
    7: "bad response", 8: "local access error", 9: "remote invalid request", 10: "remote access error",
    11: "remote operation error", 12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
    14: "local RDD violation", 15: "remote invalid RD request", 16: "remote aborted", 17: "invalid EE context number",
    18: "invalid EE context state", 19: "fatal error", 20: "response timeout", 21: "general error",
}
# ncclResult_t, for the "file.cc:123 -> N" error-return chains.
NCCL_RESULT = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError", 4: "ncclInvalidArgument",
               5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
# WARN lines that do not by themselves mean the job failed.
_BENIGN_WARN = ("NUMA auto balancing", "Failed to open libibverbs", "Unable to open device", "Ignoring",
                "GDR is not supported", "Could not find real path")


@dataclass(slots=True)
class NcclRecord:
    host: str | None
    dev: int | None
    level: str  # "INFO", "WARN", "VERSION"
    msg: str
    line: str  # the cleaned line from the host on (what the person would quote)


# Prefixes repeat (one per host, pid and device), so their parse is cached. Only short ones: a long prefix is junk
# or unique, and caching it would let one upload pin gigabytes. Shared by every thread; dict ops are atomic.
_head_cache: dict[str, tuple[str, int, int] | None] = {}
_HEAD_CACHE_MAX = 4096
_HEAD_CACHE_KEY = 256


def _head(pre: str) -> tuple[str, int, int] | None:
    """(host, dev, start of host in pre) for the text before the level marker; cached, prefixes repeat."""
    hit = _head_cache.get(pre, False)
    if hit is not False:
        return hit  # type: ignore[return-value]
    m = _HEAD_RE.search(pre)
    out = None
    if m:
        host, start = m["host"], m.start("host")
        # CloudWatch glues "...T16:39:51.208-07:00" to the host: drop the timezone's minutes ("00ip-10-...").
        if _TZ_GLUE_RE.search(pre, 0, start) and host[:2].isdigit() and host[2:3].isalpha():
            host, start = host[2:], start + 2
        out = (host, int(m["dev"]), start)
    if len(pre) <= _HEAD_CACHE_KEY:
        if len(_head_cache) >= _HEAD_CACHE_MAX:
            _head_cache.clear()
        _head_cache[pre] = out
    return out


def _value(text: str) -> str:
    """What "(.+?)\\s*$" captures from ``text``, in linear time: without trailing blanks, at least one character."""
    return text.rstrip() or text[:1]


def split_record(line: str) -> tuple[str | None, int | None, str, int, int] | None:
    """(host, dev, level, start of message, start of host) for an NCCL line; the allocation-free hot path."""
    for marker in _LEVELS:
        i = line.find(marker)
        if i >= 0:
            pre = line[:i]
            head = _head_cache.get(pre, False)
            if head is False:
                head = _head(pre)
            if head is not None:
                return head[0], head[1], "WARN" if "WARN" in marker else "INFO", i + len(marker), head[2]
    if "NCCL version " in line:
        m = _VERSION_RE.search(line)
        if m:
            return None, None, "VERSION", m.start("v"), 0
    if "NCCL WARN " in line or "NCCL INFO " in line:
        # No host:pid:tid (a launcher or a log shipper dropped it, or NCCL_DEBUG_FILE was post-processed): kept
        # when only a tag, a timestamp or a level precedes "NCCL WARN", so prose that quotes it is not taken.
        m = _HOSTLESS_RE.match(line)
        if m:
            return None, None, m["level"], m.end(), m.start("nccl")
    return None


def parse_record(line: str) -> NcclRecord | None:
    """The NCCL record in an already-cleaned line, or ``None`` when the line is not NCCL's."""
    parts = split_record(line)
    if parts is None:
        return None
    host, dev, level, at, start = parts
    if level == "VERSION":
        return NcclRecord(None, None, level, _VERSION_RE.search(line)["v"], line.strip())  # type: ignore[index]
    return NcclRecord(host, dev, level, line[at:], line[start:])


def normalize_transport(via: str) -> str:
    """'NET/IB/0/GDRDMA' -> 'IB', 'P2P/IPC/read' -> 'P2P/IPC', 'NET/AWS Libfabric/0' -> 'AWS Libfabric'."""
    via = via.strip()
    if via.startswith("NET/"):
        name = re.split(r"/\d|\(|/GDRDMA|/Shared", via[4:], maxsplit=1)[0].rstrip("/ ")
        return name or "NET"
    if via.startswith("P2P/"):
        if "CUMEM" in via:
            return "P2P/CUMEM"
        return "P2P/" + via[4:].split("/")[0]
    low = via.lower()
    if low.startswith("shm") or "shared memory" in low:
        return "SHM"
    if low.startswith("nvls"):
        return "NVLS"
    if low.startswith("collnet"):
        return "CollNet"
    return via.split("/")[0].split(" ")[0] or via


_transport_cache: dict[str, tuple[str, bool | None]] = {}


def transport_of(via: str) -> tuple[str, bool | None]:
    """(normalised transport, gdr) where gdr is None for intra-node transports."""
    hit = _transport_cache.get(via)
    if hit is None:
        name = normalize_transport(via)
        gdr = ("GDRDMA" in via) if via.startswith("NET/") else None
        hit = (name, gdr)
        if len(_transport_cache) < 4096 and len(via) <= 256:
            _transport_cache[via] = hit
    return hit


def ib_completion(msg: str) -> dict[str, str] | None:
    m = _IBWC_RE.search(msg)
    if not m:
        return None
    status = int(m["status"])
    out = {"status": str(status), "status_name": IB_WC_STATUS.get(status, "unknown"), "vendor_err": m["vendor"]}
    if m["peer"]:
        out["peer"] = m["peer"]
    return out


def is_fatal_warn(msg: str) -> bool:
    return not any(b in msg for b in _BENIGN_WARN)


# ---------------------------------------------------------------------------------------------------------------
# The doctor's accumulator.


class NcclFacts:
    """Facts of a whole NCCL log. ``feed`` returns True when the line was NCCL's (parsed, even if uninteresting)."""

    MAX_WARNINGS = 1000
    MAX_KEYS = 4096  # hosts, transports, env names, error codes: more are junk, and must not grow without end

    def __init__(self) -> None:
        self.version: str | None = None
        self.hosts: dict[str, None] = {}
        self.nranks: int | None = None
        self.transports: dict[str, None] = {}
        self.network: str | None = None
        self.gdr_used = False
        self.gdr_off = False
        self.env: dict[str, str] = {}
        self.env_drift: dict[str, set[str]] = {}
        self.warnings: dict[str, None] = {}
        self.error_codes: dict[int, int] = {}
        self.ib_errors: list[dict[str, str]] = []
        self.ib_missing = False
        self.socket_net = False  # "NET/Socket : Using ..." - the socket transport was set up for the network
        self.plugin_failed: str | None = None
        self.failed = False
        self.records = 0
        self.net_devices: dict[str, str] = {}  # "mlx5_0:1" -> "IB" | "RoCE", as NCCL listed them
        self.interfaces: dict[str, None] = {}  # the interfaces NCCL bootstrapped or ran sockets over

    def feed(self, line: str) -> bool:
        parts = split_record(line)
        if parts is None:
            return False
        self.records += 1
        host, _dev, level, at, start = parts
        if level == "VERSION":
            self.version = self.version or _VERSION_RE.search(line)["v"]  # type: ignore[index]
            return True
        if host is not None and host not in self.hosts and len(self.hosts) < self.MAX_KEYS:
            self.hosts[host] = None
        if level == "WARN":
            self._warn(line[start:], line[at:])
            return True
        v = line.rfind(" via ")
        if v >= at:
            self._via(line[v + 5:])
        else:
            self._info(line[at:])
        return True

    def _via(self, via: str) -> None:
        via = via.rstrip()
        if via:
            name, gdr = transport_of(via)
            if name not in self.transports and len(self.transports) < self.MAX_KEYS:
                self.transports[name] = None
            if gdr is True:
                self.gdr_used = True
            elif gdr is False:
                self.gdr_off = True

    def _info(self, msg: str) -> None:
        c = msg[:1]
        if c == "U" and msg.startswith("Using"):
            m = _NETWORK_RE.match(msg)
            if m:
                self.network = _value(m["net"])
        elif " set by environment to " in msg:
            self._env(msg)
        elif "nranks " in msg:
            m = _NRANKS_RE.search(msg)
            if m:
                self.nranks = max(self.nranks or 0, int(m.group(1)))
        elif "-> " in msg:
            m = _ERRRET_RE.match(msg)
            if m and m["code"] != "0":
                code = int(m["code"])
                if code in self.error_codes or len(self.error_codes) < self.MAX_KEYS:
                    self.error_codes[code] = self.error_codes.get(code, 0) + 1
                self.failed = True
        elif c == "N" and msg.startswith("NCCL version"):
            m = _VERSION_RE.match(msg)
            if m:
                self.version = self.version or m["v"]
        elif "GPU Direct RDMA " in msg or "GPUDirect RDMA" in msg:
            if "Disabled" in msg or "disabled" in msg:
                self.gdr_off = True
            elif "Enabled" in msg or "enabled" in msg:
                self.gdr_used = True
        elif msg.startswith("NET/IB : No device found"):
            self.ib_missing = True
        elif msg.startswith("NET/IB"):
            self._net_devices(msg)
        elif msg.startswith(("NET/Socket", "Bootstrap")):
            if msg.startswith("NET/Socket : Using"):
                self.socket_net = True
            for name in socket_interfaces(msg) or ():
                if len(self.interfaces) < 64:
                    self.interfaces[name] = None
        elif "Abort" in msg or "Init FAILED" in msg:
            self.failed = True
        elif msg.startswith("NET/Plugin") and ("Failed" in msg or "failed" in msg or "returned" in msg):
            self.plugin_failed = self.plugin_failed or msg

    def _net_devices(self, msg: str) -> None:
        found = net_devices(msg)
        if found is None:
            return
        devices, links, oob = found
        for dev, link in zip(devices, links, strict=True):
            if len(self.net_devices) < 64:
                self.net_devices[dev] = link
        if oob and len(self.interfaces) < 64:
            self.interfaces[oob] = None

    def inferred_transports(self) -> list[str]:
        """The transports the channel lines showed; without channel lines (NCCL_DEBUG_SUBSYS without GRAPH, or a
        log cut before the connections), the network NCCL said it uses: "Using network IB" with the HCAs it listed
        means IB (RoCE NICs run through NET/IB too), "Using network Socket" means sockets."""
        if self.transports:
            return list(self.transports)
        if self.network:
            return [self.network]
        if self.net_devices:
            return ["IB"]
        return ["Socket"] if self.socket_net else []

    def fabric(self) -> str | None:
        """"roce" when the HCAs NCCL listed are RoCE, "ib" when InfiniBand, None when it listed none."""
        links = set(self.net_devices.values())
        if not links:
            return None
        return "roce" if "RoCE" in links and "IB" not in links else "ib"

    def _env(self, msg: str) -> None:
        m = _ENV_RE.match(msg.strip())
        if not m:
            return
        name, value = m["name"], m["value"]
        if name not in self.env and len(self.env) >= self.MAX_KEYS:
            return
        old = self.env.setdefault(name, value)
        if old != value and len(self.env_drift.get(name, ())) < 16:
            self.env_drift.setdefault(name, {old}).add(value)

    def _warn(self, text: str, msg: str) -> None:
        text = text.rstrip()
        if len(self.warnings) < self.MAX_WARNINGS and text not in self.warnings:
            self.warnings[text] = None
        if is_fatal_warn(msg):
            self.failed = True
        if "completion" in msg:
            info = ib_completion(msg)
            if info and len(self.ib_errors) < 100:
                self.ib_errors.append(info)
        if "libibverbs" in msg or "Unable to open device" in msg:
            self.ib_missing = True

    def gdr(self) -> bool | None:
        if self.gdr_used:
            return True
        return False if self.gdr_off else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nccl_version": self.version,
            "hosts": sorted(self.hosts),
            "nranks": self.nranks,
            "transports": self.inferred_transports(),
            "network": self.network,
            "net_devices": [f"{d}/{link}" for d, link in self.net_devices.items()],
            "interfaces": list(self.interfaces),
            "gdr": self.gdr(),
            "env": dict(sorted(self.env.items())),
            "warnings": list(self.warnings),
            "failed": self.failed,
        }

    def findings(self) -> list[Finding]:
        from collectors.doctor.verdicts import nccl_findings

        return nccl_findings(self)


# ---------------------------------------------------------------------------------------------------------------
# The agent's live parser.


class NcclStreamParser:
    """Turns live NCCL log lines into wire ``Event`` dicts (``ts`` left to the caller).

    Keeps: WARN lines (every one), the version banner, "Using network", the transports in use (once per transport
    and rank), NVLS set up, NCCL_* "set by environment" (once per value), communicator init with nranks (once per
    comm and rank), IB completion errors (as WARN events with their decoded status), and the socket fallback.

    A transport fact carries the rank of the process that printed it (``Event.rank``), so the server can hold each
    rank's transports: the rank it has in the largest communicator its init lines named so far (the world, once the
    default group is up; ``data.nranks`` says that communicator's size so a subgroup's rank can be told apart), else
    its side of the connection line (the sender, or the receiver of a "[receive]" line). One parser may read
    several processes (a launcher's combined output): what it learns about a process is keyed by host and pid.
    Memory is bounded: the de-duplication set and the per-process table stop growing at ``MAX_SEEN`` entries."""

    MAX_SEEN = 10000
    MAX_PROCS = 4096

    def __init__(self) -> None:
        self._seen: set[tuple[str, ...]] = set()
        self._world: dict[tuple[str, str], tuple[int, int]] = {}  # (host, pid) -> (rank, nranks) of its largest comm

    def feed(self, line: str) -> list[dict[str, Any]]:
        # Fast reject: the agent tails busy training logs; nearly every line carries neither marker.
        if "INFO" not in line and "WARN" not in line and "NCCL" not in line:
            return []
        rec = parse_record(clean_line(line))
        if rec is None:
            return []
        if rec.level == "WARN":
            return [self._warn_event(rec)]
        if rec.level == "VERSION":
            return self._once(("version", rec.msg), "info", rec, {"fact": "version", "version": rec.msg})
        return self._info_event(rec)

    def _once(self, key: tuple[str, ...], severity: str, rec: NcclRecord, data: dict[str, str],
              rank: int | None = None) -> list[dict[str, Any]]:
        if key in self._seen:
            return []
        if len(self._seen) < self.MAX_SEEN:
            self._seen.add(key)
        return [_event(severity, rec, data, rank)]

    def _warn_event(self, rec: NcclRecord) -> dict[str, Any]:
        data = {"fact": "warn", "warn": sanitize(rec.msg, 1000)}
        severity = "error" if is_fatal_warn(rec.msg) else "warning"
        ib = ib_completion(rec.msg) if "completion" in rec.msg else None
        if ib:
            data.update(ib, fact="ib_error")
        return _event(severity, rec, data)

    @staticmethod
    def _proc(rec: NcclRecord) -> tuple[str, str]:
        """(host, pid) of the record's process: its line starts "host:pid:tid [dev]" when it has a host."""
        if rec.host is None:
            return ("", "")
        head = rec.line.split(" ", 1)[0].split(":")
        return (rec.host, head[1] if len(head) > 2 else "")

    def _learn_rank(self, rec: NcclRecord) -> None:
        m = _COMM_RANK_RE.search(rec.msg)
        if m is None:
            return
        rank, nranks = int(m.group(1)), int(m.group(2))
        if rank >= nranks or nranks > 1_000_000:
            return
        proc = self._proc(rec)
        had = self._world.get(proc)
        if had is None and len(self._world) >= self.MAX_PROCS:
            return
        if had is None or nranks > had[1]:
            self._world[proc] = (rank, nranks)

    def _transport_event(self, rec: NcclRecord, via: str, conn: re.Match[str] | None) -> list[dict[str, Any]]:
        name, gdr = transport_of(via)
        data = {"fact": "transport", "transport": name}
        if gdr is not None:
            data["gdr"] = "true" if gdr else "false"
        world = self._world.get(self._proc(rec))
        rank: int | None = None
        if world is not None:
            rank = world[0]
            data["nranks"] = str(world[1])
        elif conn is not None:
            rank = int(conn.group(2) if conn.group(3) == "receive" else conn.group(1))
        severity = "warning" if name == "Socket" else "info"
        key = ("transport", rec.host or "", str(rank), name, data.get("gdr", ""))
        return self._once(key, severity, rec, data, rank)

    def _info_event(self, rec: NcclRecord) -> list[dict[str, Any]]:
        msg, host = rec.msg, rec.host or ""
        at = msg.find(" via ")
        if at >= 0:
            via = _value(msg[at + 5:])
            if not via:
                return []
            return self._transport_event(rec, via, _CONN_RE.match(msg) if msg[:1] in "CR" else None)
        if "anks " in msg:
            self._learn_rank(rec)
        if msg.startswith(("NVLS comm ", "Connected NVLS")):  # NVLS buffers set up: the comm runs over NVSwitch
            return self._transport_event(rec, "NVLS", None)
        if msg.startswith("Using"):
            m = _NETWORK_RE.match(msg)
            if m:
                net = _value(m["net"])
                severity = "warning" if net == "Socket" else "info"
                world = self._world.get(self._proc(rec))
                return self._once(("network", host, net), severity, rec, {"fact": "network", "network": net},
                                  world[0] if world else None)
        if " set by environment to " in msg:
            m = _ENV_RE.match(msg.strip())
            if m:
                data = {"fact": "env", "name": m["name"], "value": m["value"][:1000]}
                return self._once(("env", host, m["name"], m["value"]), "info", rec, data)
        if "nranks " in msg:
            return self._init_event(rec)
        if msg.startswith("NCCL version"):
            m = _VERSION_RE.match(msg)
            if m:
                return self._once(("version", host, m["v"]), "info", rec, {"fact": "version", "version": m["v"]})
        if msg.startswith("NET/IB : No device found"):
            return self._once(("no_ib", host), "warning", rec, {"fact": "fallback", "reason": "no IB device"})
        if msg.startswith("NET/IB"):
            found = net_devices(msg)
            if found and found[0]:
                devices, links, oob = found
                data = {"fact": "net_devices", "devices": " ".join(devices)[:1000],
                        "links": " ".join(sorted(set(links)))}
                if oob:
                    data["oob"] = oob
                return self._once(("net_devices", host, data["devices"]), "info", rec, data)
        # The Bootstrap line is chatter every rank prints; the OOB interface of "NET/IB : Using" and the list of
        # "NET/Socket : Using" carry the same NCCL_SOCKET_IFNAME selection, once per transport set-up.
        if msg.startswith("NET/Socket"):
            names = socket_interfaces(msg)
            if names:
                data = {"fact": "interfaces", "interfaces": " ".join(names)[:1000]}
                return self._once(("interfaces", host, data["interfaces"]), "info", rec, data)
        return []

    def _init_event(self, rec: NcclRecord) -> list[dict[str, Any]]:
        m = _NRANKS_RE.search(rec.msg)
        if not m or "Init START" in rec.msg:
            return []
        rank_m, comm_m = _RANK_RE.search(rec.msg), _COMM_RE.search(rec.msg)
        rank = int(rank_m.group(1)) if rank_m else None
        data = {"fact": "init", "nranks": m.group(1)}
        if comm_m:
            data["comm"] = comm_m.group(1)
        key = ("init", rec.host or "", data.get("comm", ""), str(rank))
        return self._once(key, "info", rec, data, rank if rank is not None and rank <= 1_000_000 else None)


def _event(severity: str, rec: NcclRecord, data: dict[str, str], rank: int | None = None) -> dict[str, Any]:
    if rec.host:
        data["host"] = rec.host[:253]
    if rec.dev is not None:
        data["dev"] = str(rec.dev)
    out: dict[str, Any] = {"kind": "nccl", "severity": severity, "message": sanitize(rec.line, 2000), "data": data}
    if rank is not None:
        out["rank"] = rank
    return out
