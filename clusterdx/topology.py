"""Where nodes sit in the fabric, read from the places operators already keep it: no Django, no I/O.

* Slurm's ``topology.conf`` (``topology/tree``: ``SwitchName=leaf1 Nodes=node[001-016]``,
  ``SwitchName=spine1 Switches=leaf[1-4]``; ``topology/block``: ``BlockName=b1 Nodes=...``). A switch that lists
  nodes is their leaf; the switch that lists that leaf is their spine. A block (an NVLink domain, a rack of
  GB200s) becomes the rack. Host lists are expanded by ``python-hostlist``, the parser Slurm sites use in Python.
* A CSV file ``host,rack,switch,spine`` (a header row optional, empty cells unknown), or JSON
  (``[{"host": ..., "rack": ...}]``, ``{"nodes": [...]}`` or ``{"host": {"rack": ...}}``).
* Kubernetes node labels in the downward-API file format (``key="value"`` per line): NVIDIA Topograph's
  ``network.topology.nvidia.com/leaf`` / ``spine`` (``/block`` in its first releases), its
  ``fabric.topograph.run/tier-0`` / ``tier-1``, and ``topology.kubernetes.io/rack`` where a site labels racks.

Every place is checked by the wire's own rules for a :class:`clusterdx.wire.Topology`, so an upload can never store
a label an agent would be refused for. Mistakes raise :class:`TopologyError` naming the line.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from clusterdx import wire

FIELDS = ("rack", "switch", "spine")
MAX_HOSTS = 100_000  # far above any cluster; a bound so that node[0-99999999] cannot eat the server's memory
HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")

# place field -> node labels, first found wins. topology.kubernetes.io/zone is deliberately absent: a zone is a
# data-centre failure domain holding many racks and switches, so naming it a rack would merge them all.
K8S_LABELS: dict[str, tuple[str, ...]] = {
    "rack": ("topology.kubernetes.io/rack", "network.topology.nvidia.com/rack"),
    "switch": ("network.topology.nvidia.com/leaf", "network.topology.nvidia.com/block", "fabric.topograph.run/tier-0"),
    "spine": ("network.topology.nvidia.com/spine", "fabric.topograph.run/tier-1"),
}

Place = dict[str, str]  # a subset of FIELDS -> a checked fabric name


class TopologyError(ValueError):
    pass


def expand_hostlist(expr: str, where: str = "") -> list[str]:
    """``node[001-003,010]`` -> ``["node001", "node002", "node003", "node010"]`` (zero padding kept)."""
    import hostlist  # python-hostlist: imported here so an agent without it still starts

    try:
        hosts = hostlist.expand_hostlist(expr)
    except hostlist.BadHostlist as exc:
        raise TopologyError(f"{where}bad host list {expr!r}: {exc}") from None
    if len(hosts) > MAX_HOSTS:
        raise TopologyError(f"{where}host list {expr!r} names {len(hosts)} hosts (at most {MAX_HOSTS})")
    return hosts


def check_place(raw: Mapping[str, Any], where: str) -> Place:
    """Drop empty parts and check the rest by the wire's rules (the agents' labels obey the same)."""
    place = {k: v.strip() for k in FIELDS if isinstance(v := raw.get(k), str) and v.strip()}
    bad = [k for k in FIELDS if raw.get(k) is not None and not isinstance(raw[k], str)]
    if bad:
        raise TopologyError(f"{where}{bad[0]}: expected a string, got {raw[bad[0]]!r}")
    try:
        wire.validate(wire.Topology, place)
    except wire.WireError as exc:
        raise TopologyError(f"{where}{exc}") from None
    return place


def _check_host(host: Any, where: str) -> str:
    if not isinstance(host, str) or not HOST.fullmatch(host.strip()):
        raise TopologyError(f"{where}not a host name: {host!r}")
    return host.strip()


# -- Slurm topology.conf ---------------------------------------------------------------------------------------------

def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, line) with comments removed and ``\\`` continuations joined, as slurm.conf reads."""
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            yield start, line


def parse_slurm_topology(text: str) -> dict[str, Place]:
    """host -> place from a ``topology.conf``."""
    leaves: dict[str, list[str]] = {}  # switch -> the nodes it lists
    parents: dict[str, str] = {}  # switch -> the switch that lists it
    blocks: dict[str, str] = {}  # host -> block
    for number, line in _logical_lines(text):
        where = f"line {number}: "
        pairs = {}
        for word in line.split():
            key, eq, value = word.partition("=")
            if not eq or not value:
                raise TopologyError(f"{where}expected Key=Value, got {word!r}")
            pairs[key.lower()] = value
        if "switchname" in pairs:
            name = check_place({"switch": pairs["switchname"]}, where)["switch"]
            if "nodes" in pairs:
                leaves[name] = expand_hostlist(pairs["nodes"], where)
            for child in expand_hostlist(pairs["switches"], where) if "switches" in pairs else []:
                if parents.setdefault(child, name) != name:
                    raise TopologyError(f"{where}switch {child} is already under {parents[child]}")
        elif "blockname" in pairs:
            name = check_place({"rack": pairs["blockname"]}, where)["rack"]
            for host in expand_hostlist(pairs.get("nodes", ""), where) if "nodes" in pairs else []:
                blocks[_check_host(host, where)] = name
        elif "blocksizes" not in pairs:
            raise TopologyError(f"{where}expected SwitchName=..., BlockName=... or BlockSizes=..., got {line[:80]!r}")
    out: dict[str, Place] = {}
    for leaf, hosts in leaves.items():
        for host in hosts:
            host = _check_host(host, "")
            if host in out:
                raise TopologyError(f"node {host} is listed under two leaf switches: {out[host]['switch']} and {leaf}")
            out[host] = {"switch": leaf, **({"spine": parents[leaf]} if leaf in parents else {})}
    for host, block in blocks.items():
        out.setdefault(host, {})["rack"] = block
    if not out:
        raise TopologyError("no switch or block in this topology.conf lists any node (Nodes=...)")
    return out


# -- CSV and JSON ------------------------------------------------------------------------------------------------------

def parse_csv(text: str) -> dict[str, Place]:
    """``host,rack,switch,spine`` rows; a first row starting with ``host`` is the header and may reorder columns."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r) and not r[0].startswith("#")]
    if not rows:
        raise TopologyError("the file holds no rows (expected host,rack,switch,spine)")
    columns = ["host", *FIELDS]
    first = 1
    if rows[0][0].strip().lower() == "host":
        columns = [c.strip().lower() for c in rows[0]]
        unknown = [c for c in columns if c not in ("host", *FIELDS)]
        if unknown:
            raise TopologyError(f"line 1: unknown column {unknown[0]!r} (expected host,rack,switch,spine)")
        first = 2
    out: dict[str, Place] = {}
    for number, row in enumerate(rows[first - 1:], first):
        where = f"line {number}: "
        if len(row) > len(columns):
            raise TopologyError(f"{where}{len(row)} cells, expected at most {len(columns)} ({','.join(columns)})")
        cells = dict(zip(columns, row, strict=False))
        _add(out, _check_host(cells.get("host", ""), where), check_place(cells, where), where)
    return out


def parse_json(text: str) -> dict[str, Place]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyError(f"not valid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("nodes"), list):
        data = data["nodes"]
    out: dict[str, Place] = {}
    if isinstance(data, list):
        for i, item in enumerate(data):
            where = f"nodes[{i}]: "
            if not isinstance(item, dict):
                raise TopologyError(f"{where}expected an object with host, rack, switch, spine")
            extra = set(item) - {"host", *FIELDS}
            if extra:
                raise TopologyError(f"{where}unknown key {sorted(extra)[0]!r}")
            _add(out, _check_host(item.get("host"), where), check_place(item, where), where)
    elif isinstance(data, dict):
        for host, item in data.items():
            where = f"{host}: "
            if not isinstance(item, dict) or set(item) - set(FIELDS):
                raise TopologyError(f"{where}expected an object with rack, switch, spine")
            _add(out, _check_host(host, where), check_place(item, where), where)
    else:
        raise TopologyError("expected a list of nodes or an object keyed by host")
    if len(out) > MAX_HOSTS:
        raise TopologyError(f"{len(out)} hosts (at most {MAX_HOSTS})")
    return out


def _add(out: dict[str, Place], host: str, place: Place, where: str) -> None:
    if host in out:
        raise TopologyError(f"{where}{host} is listed twice")
    if not place:
        raise TopologyError(f"{where}{host} has no rack, switch or spine")
    out[host] = place
    if len(out) > MAX_HOSTS:
        raise TopologyError(f"more than {MAX_HOSTS} hosts")


def parse_file(text: str, name: str = "") -> dict[str, Place]:
    """Any of the three formats, by the file's name or, failing that, its content."""
    lower, head = name.lower(), text.lstrip()[:1]
    if lower.endswith(".json") or (not lower.endswith((".csv", ".conf")) and head in ("{", "[")):
        return parse_json(text)
    if lower.endswith(".conf") or re.search(r"(?im)^\s*(switchname|blockname)\s*=", text):
        return parse_slurm_topology(text)
    return parse_csv(text)


# -- Kubernetes node labels ------------------------------------------------------------------------------------------

def parse_labels(text: str) -> dict[str, str]:
    """The downward API's labels file: ``key="value"`` per line, the value quoted as Go's ``%q`` writes it."""
    labels = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, eq, value = line.partition("=")
        try:
            decoded = json.loads(value) if value.startswith('"') else value
        except json.JSONDecodeError:
            decoded = None
        if not eq or not key.strip() or not isinstance(decoded, str):
            raise TopologyError(f"line {number}: expected key=\"value\", got {line[:80]!r}")
        labels[key.strip()] = decoded
    return labels


def place_from_labels(labels: Mapping[str, str], names: Mapping[str, tuple[str, ...]] = K8S_LABELS) -> Place:
    """The node's place from its labels (``names``: place field -> label keys, first found wins)."""
    raw = {}
    for part, keys in names.items():
        found = next((labels[k] for k in keys if labels.get(k, "").strip()), None)
        if found is not None:
            raw[part] = found
    return check_place(raw, "")
