"""The agent's settings: defaults, an optional ``agent.toml``, then command-line flags, checked once at start.

The node's place in the fabric (``[topology]`` rack, switch, spine) may also come from the environment
(``CLUSTERDX_RACK``, ``CLUSTERDX_SWITCH``, ``CLUSTERDX_SPINE``), which wins over the file: a Slurm prolog or a
Kubernetes manifest knows the rack better than a config file copied to every node. Below both, ``[topology]``
may name where the site already keeps it: ``labels_file`` (the node's Kubernetes labels, downward-API format) and
``slurm_topology`` (Slurm's ``topology.conf``, looked up by this node's host name).

Every mistake is reported together, by key, with a suggestion for a misspelt name, and the agent refuses to start:
a typo that silently left a source on its default is worse than an error at install time.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from clusterdx import wire

MIN_INTERVAL_S = 0.1


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class AgentConfig:
    """Top-level keys of agent.toml; ``[sources.<name>]`` tables land in ``sources``."""

    server: str = ""  # base URL of the clusterdx server; batches go to <server>/api/v1/ingest
    token_file: str = ""  # file holding the cluster's ingest token (kept out of the config and the process list)
    agent_id: str = ""  # stable per node; default: the host name
    host: str = ""  # the node's name in the dashboard; default: the host name
    interval_s: float = 1.0  # one sample per interval, 0.1 s at the least
    # Post at most once per this many seconds, several intervals in one batch; 0 = every interval. The server may
    # ask for more (its send_interval_s advert); the larger of the two wins.
    send_interval_s: float = 0.0
    spool_path: str = ""  # SQLite file for unsent batches; default under $STATE_DIRECTORY or /var/lib/clusterdx
    spool_max_batches: int = 86_400  # a day at 1 Hz; the oldest batch goes first when full (counted, reported)
    spool_max_mb: float = 512.0
    backoff_initial_s: float = 1.0  # first retry delay after a failed delivery; doubles up to backoff_max_s
    backoff_max_s: float = 60.0
    http_timeout_s: float = 10.0
    ca_file: str = ""  # a private CA bundle for an https server
    metrics_port: int = 0  # Prometheus /metrics (dcgm-exporter names); 0 = off. dcgm-exporter's own port is 9400
    metrics_addr: str = "0.0.0.0"
    log_level: str = "info"
    # 2 (the default): the GPU, step, probe and beat records go as column blocks (clusterdx.blocks), which the
    # server checks and stores as matrices (a tenth less server CPU per node-second at 2,048 nodes than 1). A server
    # older than this release refuses them and the agent goes on in 1 (logged); a post a block cannot carry exactly
    # goes as 1.
    wire_version: int = 2
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    # rack / switch / spine as the wire's Topology record; empty = not known, and the batches carry none.
    topology: dict[str, str] = field(default_factory=dict)


# key -> (low, high) for numbers; anything not here is only type-checked.
_RANGES: dict[str, tuple[float, float]] = {
    "interval_s": (MIN_INTERVAL_S, 3600),
    "send_interval_s": (0, 3600),
    "spool_max_batches": (10, 10_000_000),
    "spool_max_mb": (1, 1_000_000),
    "backoff_initial_s": (0.01, 3600),
    "backoff_max_s": (0.01, 86_400),
    "http_timeout_s": (0.1, 600),
    "metrics_port": (0, 65_535),
    "wire_version": (1, 2),
}
_LOG_LEVELS = ("debug", "info", "warning", "error")
_TABLES = ("sources", "topology")  # keys that hold a table, not a value
TOPOLOGY_ENV = {"rack": "CLUSTERDX_RACK", "switch": "CLUSTERDX_SWITCH", "spine": "CLUSTERDX_SPINE"}
TOPOLOGY_FILES = ("labels_file", "slurm_topology")  # [topology] keys naming a file the place is read from
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*")


def suggest(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"


def _option_names() -> list[str]:
    return [f.name for f in fields(AgentConfig) if f.name not in _TABLES]


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from exc


def build(raw: dict[str, Any], overrides: dict[str, Any], known_sources: tuple[str, ...],
          environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Merge the file's values and the flags (flags win) into a checked :class:`AgentConfig`.

    ``environ`` (default ``os.environ``) supplies the topology variables."""
    problems: list[str] = []
    cfg = AgentConfig()
    types = {f.name: type(getattr(cfg, f.name)) for f in fields(AgentConfig) if f.name not in _TABLES}
    host = overrides.get("host") or raw.get("host") or socket.gethostname()
    cfg.topology = _topology(raw.get("topology", {}), os.environ if environ is None else environ, problems,
                             host if isinstance(host, str) else "")
    for key, value in {**raw, **{k: v for k, v in overrides.items() if v is not None}}.items():
        if key == "sources":
            cfg.sources = _sources(value, known_sources, problems)
        elif key == "topology":
            continue
        elif key not in types:
            problems.append(f"{key}: unknown option{suggest(key, _option_names())}")
        else:
            checked = _check(key, value, types[key], problems)
            if checked is not None:
                setattr(cfg, key, checked)
    _finish(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _check(key: str, value: Any, want: type, problems: list[str]) -> Any:
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        problems.append(f"{key}: expected {want.__name__}, got {type(value).__name__} {value!r}")
        return None
    if key in _RANGES:
        low, high = _RANGES[key]
        if not low <= value <= high:
            problems.append(f"{key}: must be between {low:g} and {high:g}, got {value!r}")
            return None
    return value


def _sources(value: Any, known: tuple[str, ...], problems: list[str]) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        problems.append("sources: expected tables such as [sources.gpu]")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, table in value.items():
        if name not in known:
            problems.append(f"sources.{name}: unknown source{suggest(name, known)}")
        elif not isinstance(table, dict):
            problems.append(f"sources.{name}: expected a table ([sources.{name}])")
        elif "enabled" in table and type(table["enabled"]) is not bool:
            problems.append(f"sources.{name}.enabled: expected true or false, got {table['enabled']!r}")
        elif name == "hooks" and not _hooks_ok(table, problems):
            continue
        else:
            out[name] = dict(table)
    return out


def _hooks_ok(table: dict[str, Any], problems: list[str]) -> bool:
    """The hook socket on a non-loopback address lets anyone who reaches the node send records as its training
    jobs: that takes an explicit ``allow_remote = true``, never a default or a copied example."""
    from collectors.agent.hooks import is_loopback, parse_addr

    allow = table.get("allow_remote", False)
    if type(allow) is not bool:
        problems.append(f"sources.hooks.allow_remote: expected true or false, got {allow!r}")
        return False
    addr = table.get("addr")
    if not isinstance(addr, str) or allow or table.get("enabled") is False:
        return True  # a wrong type is the source's own options check to report
    try:
        host = parse_addr(addr)[0]
    except ValueError as exc:
        problems.append(f"sources.hooks.addr: {exc}")
        return False
    if is_loopback(host):
        return True
    problems.append(f"sources.hooks.addr: {host} is not a loopback address, so any machine that reaches this node "
                    "could send records as its training jobs; keep 127.0.0.1:8650 (pods on the host network reach "
                    "it) or set allow_remote = true and firewall the port")
    return False


def _topology(table: Any, environ: Mapping[str, str], problems: list[str], host: str = "") -> dict[str, str]:
    """``[topology]``'s files, its values on top, the environment on top of those, checked by the wire's own rules
    (the server would refuse every batch otherwise)."""
    if not isinstance(table, dict):
        problems.append('topology: expected a table ([topology] with rack = "...", switch = "...")')
        return {}
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key in TOPOLOGY_FILES:
        if key in table:
            found = _topology_file(key, table[key], host, problems)
            merged.update(found)
            where.update({part: f"topology.{key}" for part in found})
    for key, value in table.items():
        if key in TOPOLOGY_FILES:
            continue
        if key not in TOPOLOGY_ENV:
            problems.append(f"topology.{key}: unknown option{suggest(key, (*TOPOLOGY_ENV, *TOPOLOGY_FILES))}")
        else:
            merged[key], where[key] = value, f"topology.{key}"
    for key, var in TOPOLOGY_ENV.items():
        value = environ.get(var, "").strip()
        if value:  # set but empty means "not set": an unset template variable must not erase the file's value
            merged[key], where[key] = value, var
    out: dict[str, str] = {}
    for key, value in merged.items():
        try:
            wire.validate(wire.Topology, {key: value})
        except wire.WireError as exc:
            problems.append(f"{where[key]}: {exc.message}")
        else:
            out[key] = value
    return out


def _topology_file(key: str, path: Any, host: str, problems: list[str]) -> dict[str, str]:
    """The place from the node's Kubernetes labels or from Slurm's topology.conf; {} when it names none."""
    from clusterdx import topology

    if not isinstance(path, str) or not path:
        problems.append(f"topology.{key}: expected a file path, got {path!r}")
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"topology.{key}: cannot read {path} ({getattr(exc, 'strerror', None) or exc})")
        return {}
    try:
        if key == "labels_file":
            return topology.place_from_labels(topology.parse_labels(text))
        places = topology.parse_slurm_topology(text)
    except topology.TopologyError as exc:
        problems.append(f"topology.{key}: {path}: {exc}")
        return {}
    except ModuleNotFoundError:
        problems.append(f"topology.{key}: reading topology.conf needs python-hostlist (pip install python-hostlist)")
        return {}
    return places.get(host) or places.get(host.split(".")[0]) or {}


def _finish(cfg: AgentConfig, problems: list[str]) -> None:
    """Cross-field checks and defaults that depend on the machine."""
    if not cfg.server:
        problems.append("server: required (--server URL or server = \"https://...\" in agent.toml)")
    elif not re.match(r"https?://[^/\s]+", cfg.server):
        problems.append(f"server: expected an http:// or https:// URL, got {cfg.server!r}")
    if not cfg.token_file:
        problems.append("token_file: required (--token-file F or token_file = \"/etc/clusterdx/token\")")
    if cfg.log_level not in _LOG_LEVELS:
        problems.append(f"log_level: expected one of {', '.join(_LOG_LEVELS)}, got {cfg.log_level!r}")
    if cfg.backoff_max_s < cfg.backoff_initial_s:
        problems.append("backoff_max_s: must not be below backoff_initial_s")
    node = socket.gethostname()
    cfg.host = cfg.host or _clean(node, r"[^A-Za-z0-9_.-]") or "localhost"
    cfg.agent_id = cfg.agent_id or _clean(cfg.host, r"[^A-Za-z0-9._:@/+-]")
    if not _IDENT.fullmatch(cfg.agent_id) or len(cfg.agent_id) > 128:
        problems.append(f"agent_id: letters, digits and ._:@/+- only (at most 128), got {cfg.agent_id!r}")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", cfg.host) or len(cfg.host) > 253:
        problems.append(f"host: not a valid host name: {cfg.host!r}")
    cfg.spool_path = cfg.spool_path or default_spool_path()
    probes = cfg.sources.get("probes")
    if probes is not None and probes.get("plan") == "server":
        # Server-planned peers are asked for with the delivery's own server, token and CA, as this node's host name.
        for key, value in (("server", cfg.server), ("token_file", cfg.token_file), ("ca_file", cfg.ca_file),
                           ("self_name", cfg.host), ("http_timeout_s", cfg.http_timeout_s)):
            probes.setdefault(key, value)


def _clean(text: str, bad: str) -> str:
    return re.sub(bad, "-", text).strip("-.")


def default_spool_path() -> str:
    # systemd's StateDirectory= sets $STATE_DIRECTORY; root elsewhere gets /var/lib; a user gets ~/.local/state.
    base = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if not base:
        base = "/var/lib/clusterdx" if os.geteuid() == 0 else str(Path.home() / ".local/state/clusterdx")
    return str(Path(base) / "spool.sqlite3")


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError([f"token_file: cannot read {path} ({exc.strerror})"]) from exc
    if not token or any(c.isspace() for c in token):
        raise ConfigError([f"token_file: {path} must hold one token on one line"])
    return token

