"""The host: CPU, load, memory, disk and network I/O (psutil), and NFS latency per mount (``/proc/self/mountstats``).

NFS is here because a training job that reads its data set from NFS stalls when the server is slow, and the GPU
side shows only idle time. The kernel keeps, per mount and per RPC operation, cumulative counts of operations,
round-trip time (request sent → reply received, the network and the server) and execution time (queued → done,
what the application waits for), both in milliseconds. Differences of two readings give, for the interval, the
average RTT and execution time over all operations (so READ-heavy traffic weighs READ) and operations per second.

A per-op line after "per-op statistics" in mountstats reads::

    READ: ops transmissions major_timeouts bytes_sent bytes_recv queue_ms rtt_ms execute_ms [errors]
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from collectors.agent.source import Collected

log = logging.getLogger(__name__)

_OCTAL = re.compile(r"\\([0-7]{3})")
_NFS_FSTYPES = frozenset({"nfs", "nfs4"})
_MAX_NFS_MOUNTS = 64  # wire bound on HostSample.nfs
# Interfaces whose traffic is counted elsewhere already (loopback) or twice (bridges and the veths behind them,
# IFB mirrors of real interfaces).
DEFAULT_NET_EXCLUDE: tuple[str, ...] = ("lo", "ifb", "veth", "docker", "br-", "virbr", "cni", "flannel", "cali",
                                        "tunl", "vxlan")
SYS_NET = "/sys/class/net"
_MAX_INTERFACES = 512  # wire bound on HostSample.interfaces
_MAX_ADDRESSES = 32  # wire bound on NetInterface.addresses
_IF_NAME = re.compile(r"[!-.0-~]{1,15}")  # wire.IfName
_ARPHRD = {"1": "ether", "32": "infiniband", "772": "loopback"}  # include/uapi/linux/if_arp.h
_OPERSTATES = frozenset({"up", "down", "unknown", "dormant", "lowerlayerdown", "notpresent", "testing"})


@dataclass(frozen=True, slots=True)
class NfsTotals:
    """Cumulative counters of one NFS mount, summed over its operations."""

    server: str
    age_s: int
    ops: int
    rtt_ms: int
    exe_ms: int


def _unescape(path: str) -> str:
    r"""Mount points in mountstats escape space, tab, newline and backslash as octal (``\040``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), path) if "\\" in path else path


def parse_mountstats(text: str) -> dict[str, NfsTotals]:
    """NFS mounts by mount point, each with its operations summed. Other file systems are skipped."""
    mounts: dict[str, NfsTotals] = {}
    current: str | None = None
    server = ""
    age = ops = rtt = exe = 0
    in_ops = False
    for line in text.splitlines():
        if line.startswith("device "):
            if current is not None:
                mounts[current] = NfsTotals(server, age, ops, rtt, exe)
            current, server = _device_line(line)
            age = ops = rtt = exe = 0
            in_ops = False
        elif current is None:
            continue
        elif in_ops:
            fields = line.split()
            if len(fields) >= 9 and fields[0].endswith(":"):
                # ops, transmissions, timeouts, bytes sent, bytes received, queue, rtt, execute[, errors]
                ops += int(fields[1])
                rtt += int(fields[7])
                exe += int(fields[8])
        elif line.startswith("\tage:"):
            age = int(line.split()[1])
        elif line.strip() == "per-op statistics":
            in_ops = True
    if current is not None:
        mounts[current] = NfsTotals(server, age, ops, rtt, exe)
    return mounts


def _device_line(line: str) -> tuple[str | None, str]:
    """ "device srv:/export mounted on /mnt with fstype nfs4 statvers=1.1" -> ("/mnt", "srv:/export")."""
    try:
        head, fstype_part = line[len("device "):].rsplit(" with fstype ", 1)
        device, mount = head.split(" mounted on ", 1)
    except ValueError:
        return None, ""
    if fstype_part.split()[0] not in _NFS_FSTYPES:
        return None, ""
    return _unescape(mount), device


def nfs_interval(prev: NfsTotals, cur: NfsTotals, interval_s: float) -> dict[str, Any]:
    """One wire NfsMount's numbers from two readings; averages are None when no operation completed."""
    d_ops = cur.ops - prev.ops
    if cur.age_s < prev.age_s or d_ops < 0 or cur.rtt_ms < prev.rtt_ms or cur.exe_ms < prev.exe_ms:
        return {"ops_per_s": None, "rtt_ms": None, "exe_ms": None}  # remounted: this interval is unknown
    if d_ops == 0:
        return {"ops_per_s": 0.0, "rtt_ms": None, "exe_ms": None}
    return {
        "ops_per_s": d_ops / interval_s,
        "rtt_ms": (cur.rtt_ms - prev.rtt_ms) / d_ops,
        "exe_ms": (cur.exe_ms - prev.exe_ms) / d_ops,
    }


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:  # EINVAL: speed of a link that is down, or of loopback
        return None


def _int(text: str | None, hi: int) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value <= hi else None  # speed -1: unknown


def read_interfaces(root: str = SYS_NET, addresses: dict[str, list[str]] | None = None) -> list[dict[str, Any]] | None:
    """The node's interfaces as wire NetInterface records, physical ones first then by name; None when ``root`` cannot
    be listed (not Linux). Names the wire cannot carry (no kernel makes them, but sysfs is not ours to trust) are
    left out with a warning, as are interfaces past the wire's bound."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    out = []
    for name in names:
        if not _IF_NAME.fullmatch(name):
            log.warning("host: interface name %r cannot be sent (not 1-15 printable characters); left out", name[:40])
            continue
        base = os.path.join(root, name)
        state = _read(os.path.join(base, "operstate"))
        out.append({
            "name": name, "state": state if state in _OPERSTATES else None,
            "kind": _ARPHRD.get(_read(os.path.join(base, "type")) or "", "other"),
            # Real devices have a "device" link to their bus device; veths, bridges, bonds and tunnels do not.
            "virtual": not os.path.exists(os.path.join(base, "device")),
            "mtu": _int(_read(os.path.join(base, "mtu")), 1_000_000),
            "speed_mbps": _int(_read(os.path.join(base, "speed")), 100_000_000),
            "addresses": (addresses or {}).get(name, [])[:_MAX_ADDRESSES],
        })
    out.sort(key=lambda i: (i["virtual"], i["name"]))
    if len(out) > _MAX_INTERFACES:
        log.warning("host: %d interfaces, only the first %d are sent", len(out), _MAX_INTERFACES)
        del out[_MAX_INTERFACES:]
    return out


def if_addresses(psutil: Any) -> dict[str, list[str]]:
    """name -> ["10.0.0.7/24", "fe80::1/64"] from ``psutil.net_if_addrs()`` (getifaddrs: one call for every
    interface). IPv6 zones ("%eth0") are dropped: the interface is the zone."""
    out: dict[str, list[str]] = {}
    try:
        table = psutil.net_if_addrs()
    except (OSError, RuntimeError):
        return out
    for name, addrs in table.items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                iface = ipaddress.ip_interface(f"{a.address.split('%')[0]}/{a.netmask}" if a.netmask else
                                               a.address.split("%")[0])
            except ValueError:
                continue
            out.setdefault(name, []).append(iface.with_prefixlen)
    return out


class HostSource:
    """One :class:`clusterdx.wire.HostSample` per interval.

    Options (the ``[sources.host]`` table of agent.toml):

    * ``mountstats`` (``"/proc/self/mountstats"``): where to read NFS statistics; ``""`` turns NFS off.
    * ``net_include`` (``None`` = all but ``net_exclude``): interfaces whose traffic counts, e.g. ``["eth0", "ib0"]``.
    * ``net_exclude`` (loopback, bridges, veths, IFB...): interface name prefixes left out of the network rates.
    * ``sys_net`` (``"/sys/class/net"``): where to list the interfaces; ``""`` turns the interface list off.
    * ``interfaces_check_s`` (15): how often the interfaces are read; a sample carries them only when they changed
      (a link went down, an address came) or ``interfaces_every_s`` (300) passed since they were last sent, so that a
      server that lost them (restored, replaced) has them again within minutes. At 2,048 nodes that is a few lists
      a second instead of 2,048.

    Rates (disk, network, NFS ops/s) need two readings, so the first sample has them as ``None``.
    """

    name = "host"

    def __init__(self, *, mountstats: str = "/proc/self/mountstats", net_include: list[str] | None = None,
                 net_exclude: list[str] | tuple[str, ...] = DEFAULT_NET_EXCLUDE, sys_net: str = SYS_NET,
                 interfaces_check_s: float = 15.0, interfaces_every_s: float = 300.0) -> None:
        self.mountstats = mountstats
        self.sys_net = sys_net
        self.interfaces_check_s = interfaces_check_s
        self.interfaces_every_s = interfaces_every_s
        self._if_checked: float | None = None
        self._if_sent: list[dict[str, Any]] | None = None
        self._if_sent_at = 0.0
        self.net_include = set(net_include) if net_include else None
        self.net_exclude = tuple(net_exclude)
        self._psutil: Any = None
        self._prev_ts: float | None = None
        self._prev_io: tuple[float, float, float, float] | None = None
        self._prev_nfs: dict[str, NfsTotals] = {}

    def start(self) -> str | None:
        try:
            import psutil
        except ImportError:
            psutil = None
        self._psutil = psutil
        nfs_ok = bool(self.mountstats) and os.access(self.mountstats, os.R_OK)
        if psutil is None and not nfs_ok:
            return "psutil is not installed (pip install 'clusterdx[agent]') and no readable mountstats"
        if psutil is None:
            log.warning("host: psutil is not installed, only load and NFS reported (pip install 'clusterdx[agent]')")
        else:
            psutil.cpu_percent(None)  # the first call only sets the reference point
        return None

    def collect(self, now: float, out: Collected) -> None:
        interval = now - self._prev_ts if self._prev_ts is not None and now > self._prev_ts else None
        sample: dict[str, Any] = {"ts": now, "load1": _load1()}
        if self._psutil is not None:
            sample.update(self._psutil_fields(interval))
        sample["nfs"] = self._nfs(interval)
        interfaces = self._interfaces(now)
        if interfaces is not None:
            sample["interfaces"] = interfaces
        self._prev_ts = now
        out.hosts.append(sample)

    def close(self) -> None:
        self._prev_nfs.clear()
        self._if_checked, self._if_sent = None, None  # started again, it sends them at once

    # -- psutil ---------------------------------------------------------------------------------------------------

    def _psutil_fields(self, interval: float | None) -> dict[str, Any]:
        ps = self._psutil
        mem = ps.virtual_memory()
        fields: dict[str, Any] = {
            "cpu_pct": min(100.0, max(0.0, float(ps.cpu_percent(None)))),
            # "available" is what a new allocation can get without swapping; used = total - available is the
            # pressure that matters, unlike psutil's "used" which leaves out reclaimable caches differently per OS.
            "mem_used_bytes": int(mem.total - mem.available),
            "mem_total_bytes": int(mem.total),
        }
        io = self._io_totals()
        if io is not None and self._prev_io is not None and interval:
            names = ("disk_read_bytes_per_s", "disk_write_bytes_per_s", "net_rx_bytes_per_s", "net_tx_bytes_per_s")
            for name, cur, prev in zip(names, io, self._prev_io, strict=True):
                fields[name] = max(0.0, (cur - prev) / interval)
        self._prev_io = io
        return fields

    def _io_totals(self) -> tuple[float, float, float, float] | None:
        ps = self._psutil
        try:
            disk = ps.disk_io_counters()  # whole disks only, partitions are not double counted
            nics = ps.net_io_counters(pernic=True)
        except (OSError, RuntimeError):
            return None
        rx = tx = 0
        for nic, counters in nics.items():
            if self._counts(nic):
                rx += counters.bytes_recv
                tx += counters.bytes_sent
        read, write = (disk.read_bytes, disk.write_bytes) if disk is not None else (0, 0)
        return float(read), float(write), float(rx), float(tx)

    def _counts(self, nic: str) -> bool:
        if self.net_include is not None:
            return nic in self.net_include
        return not nic.startswith(self.net_exclude)

    # -- interfaces -----------------------------------------------------------------------------------------------

    def _interfaces(self, now: float) -> list[dict[str, Any]] | None:
        """The interface list when it is due (changed, or not sent for ``interfaces_every_s``); None otherwise."""
        if not self.sys_net:
            return None
        # A clock stepped back counts as due: the next check must not wait for the old time to come round again.
        if self._if_checked is not None and 0 <= now - self._if_checked < self.interfaces_check_s:
            return None
        self._if_checked = now
        current = read_interfaces(self.sys_net, if_addresses(self._psutil) if self._psutil is not None else None)
        if current is None:
            return None
        if current == self._if_sent and 0 <= now - self._if_sent_at < self.interfaces_every_s:
            return None
        self._if_sent, self._if_sent_at = current, now
        return current

    # -- NFS ------------------------------------------------------------------------------------------------------

    def _nfs(self, interval: float | None) -> list[dict[str, Any]] | None:
        if not self.mountstats:
            return None
        try:
            with open(self.mountstats, encoding="utf-8", errors="replace") as f:
                current = parse_mountstats(f.read())
        except (OSError, ValueError):
            return None
        mounts = []
        for mount, totals in list(current.items())[:_MAX_NFS_MOUNTS]:
            record: dict[str, Any] = {"mount": mount[:1024], "server": totals.server[:1024]}
            prev = self._prev_nfs.get(mount)
            if prev is not None and interval:
                record.update(nfs_interval(prev, totals, interval))
            mounts.append(record)
        self._prev_nfs = current
        return mounts


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
