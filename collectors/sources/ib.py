"""InfiniBand / RoCE ports from ``/sys/class/infiniband``: state, rate and the counters that show a bad link.

Layout read (one directory per HCA, one per port)::

    <root>/mlx5_0/ports/1/state            "4: ACTIVE"
    <root>/mlx5_0/ports/1/phys_state       "5: LinkUp"
    <root>/mlx5_0/ports/1/rate             "400 Gb/sec (4X NDR)"
    <root>/mlx5_0/ports/1/link_layer       "InfiniBand" | "Ethernet"
    <root>/mlx5_0/ports/1/counters/*       PMA counters (symbol_error, port_xmit_data, ...)
    <root>/mlx5_0/ports/1/hw_counters/*    driver counters, where the driver has them (out_of_buffer, ...)

Counters go on the wire as deltas over the interval. The PMA error counters do not wrap: each has a fixed width
(4 to 32 bits) and *sticks* at its maximum until someone clears it (``perfquery -x -R``). A counter at its maximum
therefore says nothing about the interval: it is left out of ``counters`` and named in ``unavailable`` instead of
being reported as a fake 0. A counter that went down was cleared (or the driver reloaded): its delta counts from 0.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from collectors.agent.source import Collected

log = logging.getLogger(__name__)

# PMA PortCounters field widths (IBTA spec, PortCounters attribute). The data and packet counters are 32 bits in
# the legacy attribute and 64 bits in PortCountersExtended; the kernel serves whichever the HCA supports, so a
# value stuck at 2**32 - 1 is the legacy counter saturated. Names not listed are treated as 64-bit (never stick).
_WIDTH_BITS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
}

DEFAULT_COUNTERS: tuple[str, ...] = (
    "symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "port_rcv_remote_physical_errors",
    "port_xmit_discards", "port_xmit_wait", "excessive_buffer_overrun_errors", "local_link_integrity_errors",
    "port_rcv_constraint_errors", "VL15_dropped",
    "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
)
_RATE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_HW_PREFIX = "hw."  # hw_counters names share the dict with the PMA names; the prefix keeps them apart
_MAX_COUNTERS = 128  # wire bound on PortSample.counters
# Files in hw_counters/ that are settings, not counters (mlx5's "lifespan" is the counter cache time in ms).
_HW_SETTINGS = frozenset({"lifespan"})


def _read(path: str) -> str | None:
    """One small sysfs file; None when absent or unreadable (a port that vanished, a counter the HCA lacks)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError:  # some counters answer EINVAL/EIO when the port is down
        return None
    finally:
        os.close(fd)


def parse_state(text: str | None) -> str | None:
    """ "4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LinkUp"."""
    if not text:
        return None
    return text.split(":", 1)[-1].strip()[:32] or None


def parse_rate_gbps(text: str | None) -> float | None:
    """ "400 Gb/sec (4X NDR)" -> 400.0; "2.5 Gb/sec (1X SDR)" -> 2.5; anything else -> None."""
    if not text:
        return None
    m = _RATE_RE.match(text)
    return float(m.group(1)) if m else None


def counter_delta(name: str, prev: int | None, cur: int | None) -> tuple[int | None, str | None]:
    """(delta, why it is None). A counter at the maximum of its width is saturated; one that fell was cleared."""
    if cur is None:
        return None, "not readable"
    bits = _WIDTH_BITS.get(name, 64)  # hw.* names are driver counters: 64-bit
    # Equality, not >=: the kernel serves the 64-bit extended data counters under the same names, and those pass
    # 2**32 - 1 without sticking there.
    if bits < 64 and cur == (1 << bits) - 1:
        return None, f"saturated at {cur} ({bits}-bit); clear it with perfquery -x -R"
    if prev is None:
        return None, None  # first sight: no interval yet
    if cur < prev:
        return cur, None  # cleared or driver reloaded: everything since counts from 0
    return cur - prev, None


_ATTRS = ("state", "phys_state", "rate")


@dataclass
class _Port:
    """One port's files. They are held open and re-read with pread at offset 0, which makes sysfs produce a fresh
    value: a quarter of the cost of open/read/close each time, which matters with ~50 files per port per second."""

    device: str
    port: int
    link_layer: str | None  # fixed by the HCA's firmware: read once
    files: dict[str, str]  # "state", "symbol_error", "hw.out_of_buffer" -> sysfs path
    fds: dict[str, int] = field(default_factory=dict)
    prev: dict[str, int] = field(default_factory=dict)
    prev_ts: float | None = None

    def open(self, budget: int) -> int:
        """(Re)open up to ``budget`` files, the rest are read by path; returns how many are held."""
        self.close()
        for key, path in list(self.files.items())[:budget]:
            with contextlib.suppress(OSError):  # absent now, or out of descriptors: read by path instead
                self.fds[key] = os.open(path, os.O_RDONLY)
        return len(self.fds)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def read(self, key: str) -> str | None:
        fd = self.fds.get(key)
        if fd is None:
            return _read(self.files[key])
        try:
            return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
        except OSError:  # some counters answer EINVAL/EIO while the port is down; ENODEV once the HCA is gone
            return None

    def read_int(self, key: str) -> int | None:
        text = self.read(key)
        try:
            return int(text, 0) if text else None
        except ValueError:
            return None


class IbSource:
    """InfiniBand / RoCE ports, one :class:`clusterdx.wire.PortSample` per port per interval.

    Options (the ``[sources.ib]`` section of agent.toml):

    * ``root`` (``"/sys/class/infiniband"``): where the HCAs are; tests point it at a fixture tree.
    * ``counters`` (the bad-link set plus data and packet counters): PMA counters to read from ``counters/``.
    * ``hw_counters`` (``True``): also read every file in ``hw_counters/``, sent as ``hw.<name>``.
    * ``devices`` (``None`` = all): only these HCAs, e.g. ``["mlx5_0", "mlx5_1"]``.
    * ``data_word_bytes`` (``4``): ``port_xmit_data``/``port_rcv_data`` count 4-byte words (octets / 4).
    * ``rescan_s`` (``60``): how often to look for HCAs and ports that appeared or went away.
    * ``max_open_files`` (``1024``): sysfs files held open for cheap re-reads (~50 per port); past it, files are
      opened at each read. Holding them needs ``LimitNOFILE`` above the common soft limit of 1024 on big nodes.
    """

    name = "ib"

    def __init__(self, *, root: str = "/sys/class/infiniband", counters: list[str] | tuple[str, ...] = DEFAULT_COUNTERS,
                 hw_counters: bool = True, devices: list[str] | None = None, data_word_bytes: int = 4,
                 rescan_s: float = 60.0, max_open_files: int = 1024) -> None:
        self.root = root
        self.counters = list(counters)
        self.hw_counters = hw_counters
        self.devices = set(devices) if devices else None
        self.data_word_bytes = data_word_bytes
        self.rescan_s = rescan_s
        self.max_open_files = max_open_files
        self._ports: dict[tuple[str, int], _Port] = {}
        self._scanned_at = -math.inf

    def start(self) -> str | None:
        if not os.path.isdir(self.root):
            return f"no InfiniBand/RoCE devices ({self.root} does not exist)"
        self._scan()
        if not self._ports:
            return f"no InfiniBand/RoCE ports under {self.root}"
        return None

    def collect(self, now: float, out: Collected) -> None:
        if time.monotonic() - self._scanned_at >= self.rescan_s:
            self._scan()
        for port in self._ports.values():
            out.ports.append(self._sample(port, now))

    def close(self) -> None:
        for port in self._ports.values():
            port.close()
        self._ports.clear()

    # -- discovery ------------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the port list, keeping the previous readings of ports that are still there. Files are reopened,
        so that an HCA whose driver was reloaded (same names, new sysfs nodes) is read again."""
        found: dict[tuple[str, int], _Port] = {}
        for device in _listdir(self.root):
            if self.devices is not None and device not in self.devices:
                continue
            ports_dir = os.path.join(self.root, device, "ports")
            for entry in _listdir(ports_dir):
                if entry.isdigit():
                    key = (device, int(entry))
                    path = os.path.join(ports_dir, entry)
                    found[key] = self._ports.get(key) or self._new_port(device, int(entry), path)
        for key, gone in self._ports.items():
            if key not in found:
                gone.close()
        budget = self.max_open_files
        for port in found.values():
            budget -= port.open(budget)
        self._ports = found
        self._scanned_at = time.monotonic()

    def _new_port(self, device: str, port: int, path: str) -> _Port:
        files = {attr: os.path.join(path, attr) for attr in _ATTRS}
        present = set(_listdir(os.path.join(path, "counters")))
        names = [c for c in self.counters if c in present][:_MAX_COUNTERS]
        files.update((name, os.path.join(path, "counters", name)) for name in names)
        if self.hw_counters:
            hw = [n for n in _listdir(os.path.join(path, "hw_counters")) if n not in _HW_SETTINGS]
            for name in hw[: _MAX_COUNTERS - len(names)]:
                files[_HW_PREFIX + name] = os.path.join(path, "hw_counters", name)
        link_layer = _read(os.path.join(path, "link_layer"))
        return _Port(device, port, link_layer[:32] if link_layer else None, files)

    # -- sampling -------------------------------------------------------------------------------------------------

    def _sample(self, port: _Port, now: float) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ts": now,
            "device": port.device[:64],
            "port": port.port,
            "state": parse_state(port.read("state")),
            "phys_state": parse_state(port.read("phys_state")),
            "rate_gbps": parse_rate_gbps(port.read("rate")),
            "link_layer": port.link_layer,
        }
        values = {key: port.read_int(key) for key in port.files if key not in _ATTRS}
        interval = now - port.prev_ts if port.prev_ts is not None and now > port.prev_ts else None
        deltas: dict[str, int] = {}
        unavailable: dict[str, str] = {}
        for name, cur in values.items():
            delta, why = counter_delta(name, port.prev.get(name), cur)
            if delta is not None and interval is not None:
                deltas[name] = delta
            elif why:
                unavailable[name] = why[:128]
        port.prev = {k: v for k, v in values.items() if v is not None}
        port.prev_ts = now
        if interval is not None:
            record["interval_s"] = round(interval, 6)
            record["counters"] = deltas
            record["xmit_bytes_per_s"] = self._rate(deltas.get("port_xmit_data"), interval)
            record["rcv_bytes_per_s"] = self._rate(deltas.get("port_rcv_data"), interval)
        if unavailable:
            record["unavailable"] = unavailable
        return record

    def _rate(self, words: int | None, interval: float) -> float | None:
        return None if words is None else words * self.data_word_bytes / interval


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
