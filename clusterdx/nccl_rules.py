"""The NCCL settings audit: one rule table for the live diagnosis (dashboard.diagnosis.detectors.nccl) and the log
doctor (collectors.doctor.verdicts). Standard library only: neither Django nor torch.

``audit(env, ...)`` checks one NCCL environment (NCCL_* as the ranks were launched with, or as an NCCL_DEBUG=INFO log
printed them: "NCCL_X set by environment to Y") against what the node really has, and returns a :class:`Hit` per
broken rule, each with the reason and the fix. What the caller does not know (the interconnect, the node's HCAs or
interfaces, the scale) is ``None`` and the rules that need it stay quiet: no guessing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# NCCL's defaults, and the values the seed tunes for large IB/RoCE jobs.
IB_TIMEOUT_DEFAULT = 20  # 4.096 µs × 2^20 ≈ 4.3 s per retry
IB_TIMEOUT_SEED = 22  # ≈ 17 s: rides out congestion and switch reroutes on large fabrics
IB_TIMEOUT_MIN_AT_SCALE = 18
SCALE_RANKS = 512
IB_RETRY_CNT_DEFAULT = 7  # also the verbs maximum


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str  # "info" | "warning" | "error"
    reason: str  # why it matters (the seed's reason)
    fix: str


@dataclass(frozen=True)
class Hit:
    rule: str
    severity: str
    var: str
    value: str | None
    title: str  # what is wrong, with the value
    reason: str
    fix: str

    def sentence(self) -> str:
        return f"{self.title}: {self.reason} → {self.fix}"


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("ib_timeout_low_at_scale", "warning",
         "each IB retry waits 4.096 µs × 2^NCCL_IB_TIMEOUT; below 18 congestion at this scale outlasts the retries "
         "and collectives die with completion error 12 (transport retry counter exceeded)",
         f"set NCCL_IB_TIMEOUT={IB_TIMEOUT_SEED} for every rank"),
    Rule("ib_timeout_default", "info",
         f"NCCL's default {IB_TIMEOUT_DEFAULT} (≈ 4.3 s per retry) is what the seed raises: large jobs on a busy fabric "
         "hit retry-exceeded errors that a longer timeout rides out",
         f"set NCCL_IB_TIMEOUT={IB_TIMEOUT_SEED}"),
    Rule("ib_retry_cnt_low", "warning",
         f"fewer IB retries (NCCL's default and the maximum is {IB_RETRY_CNT_DEFAULT}) turn a brief link hiccup into a "
         "failed collective",
         f"unset NCCL_IB_RETRY_CNT (or set it to {IB_RETRY_CNT_DEFAULT})"),
    Rule("socket_ifname_missing", "error",
         "NCCL bootstraps (and falls back to sockets) over the interfaces NCCL_SOCKET_IFNAME selects; naming one the "
         "node does not have fails the init (\"no socket interface found\") or picks nothing usable",
         "set NCCL_SOCKET_IFNAME to an interface every node has (a prefix such as 'ens' or 'ib' matches several; "
         "'=' makes it exact, '^' excludes), never lo or docker0"),
    Rule("ib_hca_missing", "error",
         "NCCL_IB_HCA selects the HCAs NCCL may use; when none of them exists on the node NCCL finds no IB device and "
         "runs the job over TCP sockets",
         "set NCCL_IB_HCA to the node's HCAs (ibv_devinfo -l; a prefix such as 'mlx5' matches them all) or unset it"),
    Rule("p2p_disabled", "warning",
         "NCCL_P2P_DISABLE=1 stops GPUs on a node talking over NVLink / PCIe peer-to-peer: intra-node traffic goes "
         "through host memory at a fraction of the bandwidth",
         "unset NCCL_P2P_DISABLE (a workaround for broken P2P/IOMMU setups; fix ACS/IOMMU instead)"),
    Rule("shm_disabled", "warning",
         "NCCL_SHM_DISABLE=1 removes the shared-memory path between GPUs that cannot use P2P; their traffic goes over "
         "the network instead",
         "unset NCCL_SHM_DISABLE (containers: give /dev/shm enough room, e.g. --shm-size or --ipc=host)"),
    Rule("algo_forced", "info",
         "a forced NCCL_ALGO overrides NCCL's per-size tuning (tree for latency, ring for bandwidth, NVLS/CollNet "
         "where present); usually left from a benchmark or a workaround",
         "unset NCCL_ALGO unless a measured case needs it"),
    Rule("proto_forced", "info",
         "a forced NCCL_PROTO overrides NCCL's per-size choice of LL / LL128 / Simple: small messages lose latency "
         "(Simple) or large ones lose bandwidth (LL)",
         "unset NCCL_PROTO unless a measured case needs it"),
    Rule("gid_index_unset_roce", "warning",
         "on RoCE the GID index picks RoCE v1/v2 and IPv4/IPv6; left unset NCCL may pick a GID that the switches do "
         "not route or that misses the lossless (PFC/ECN) traffic class: hangs, ibv_modify_qp failures, retransmits",
         "set NCCL_IB_GID_INDEX to the RoCE v2 IPv4 GID (show_gids; usually 3) and NCCL_IB_TC to the lossless class"),
    Rule("debug_verbose", "info",
         "NCCL_DEBUG=INFO/TRACE writes lines for every communicator and connection on every rank: large logs and "
         "slower init at scale; TRACE also slows every collective",
         "use NCCL_DEBUG=WARN in production; turn INFO on for one run when debugging"),
)}


def _hit(name: str, var: str, value: str | None, title: str, *, severity: str | None = None,
         extra: str = "") -> Hit:
    rule = RULES[name]
    return Hit(name, severity or rule.severity, var, value, title, rule.reason + extra, rule.fix)


def _int(value: str | None) -> int | None:
    try:
        return int(value.strip()) if value is not None else None
    except ValueError:
        return None


def parse_list(spec: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """NCCL's device list syntax (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): ``[^][=]name[:port],name...``.
    Returns (exclude, exact, [(name, port or None)])."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    items: list[tuple[str, int | None]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, port = part.partition(":")
        items.append((name, _int(port) if port else None))
    return exclude, exact, items


def selects(spec: str, available: Iterable[str]) -> list[str]:
    """The names in ``available`` that a NCCL_SOCKET_IFNAME / NCCL_IB_HCA value selects (prefix match unless '=')."""
    exclude, exact, items = parse_list(spec)
    names = [n for n, _ in items]

    def match(dev: str) -> bool:
        return any(dev == n if exact else dev.startswith(n) for n in names)

    return [d for d in available if match(d) != exclude]


def audit(env: dict[str, str], *, interconnect: str | None = None, world_size: int | None = None,
          hcas: Iterable[str] | None = None, interfaces: Iterable[str] | None = None,
          scale_ranks: int = SCALE_RANKS, min_at_scale: int = IB_TIMEOUT_MIN_AT_SCALE) -> list[Hit]:
    """Every rule ``env`` breaks. ``interconnect``: "ib" | "roce" | "eth" (None: unknown); ``hcas``: the node's RDMA
    device names (mlx5_0, ...); ``interfaces``: its network interface names. None means unknown, not "none".
    ``scale_ranks`` / ``min_at_scale``: from where a job counts as large, and the least IB timeout it needs."""
    out: list[Hit] = []
    rdma = interconnect in ("ib", "roce")
    out += _ib_timeout(env, rdma, world_size, scale_ranks, min_at_scale)
    retry = _int(env.get("NCCL_IB_RETRY_CNT"))
    if rdma and retry is not None and retry < IB_RETRY_CNT_DEFAULT:
        out.append(_hit("ib_retry_cnt_low", "NCCL_IB_RETRY_CNT", str(retry), f"NCCL_IB_RETRY_CNT={retry}"))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and interfaces is not None:
        have = sorted(set(interfaces))
        if have and not selects(ifname, have):
            out.append(_hit("socket_ifname_missing", "NCCL_SOCKET_IFNAME", ifname,
                            f"NCCL_SOCKET_IFNAME={ifname} selects none of the node's interfaces ({', '.join(have)})"))
    hca = env.get("NCCL_IB_HCA")
    if hca and hcas is not None and env.get("NCCL_IB_DISABLE", "0").strip() in ("0", ""):
        have = sorted(set(hcas))
        if have and not selects(hca, have):
            out.append(_hit("ib_hca_missing", "NCCL_IB_HCA", hca,
                            f"NCCL_IB_HCA={hca} selects none of the node's HCAs ({', '.join(have)})"))
    for var, rule in (("NCCL_P2P_DISABLE", "p2p_disabled"), ("NCCL_SHM_DISABLE", "shm_disabled")):
        if env.get(var, "").strip() == "1":
            out.append(_hit(rule, var, "1", f"{var}=1"))
    for var, rule in (("NCCL_ALGO", "algo_forced"), ("NCCL_PROTO", "proto_forced")):
        if env.get(var, "").strip():
            out.append(_hit(rule, var, env[var], f"{var}={env[var]} is forced"))
    if interconnect == "roce" and not env.get("NCCL_IB_GID_INDEX", "").strip() \
            and env.get("NCCL_IB_DISABLE", "0").strip() in ("0", ""):
        out.append(_hit("gid_index_unset_roce", "NCCL_IB_GID_INDEX", None, "NCCL_IB_GID_INDEX is unset on RoCE"))
    debug = env.get("NCCL_DEBUG", "").strip().upper()
    if debug in ("INFO", "TRACE"):
        out.append(_hit("debug_verbose", "NCCL_DEBUG", env["NCCL_DEBUG"], f"NCCL_DEBUG={env['NCCL_DEBUG']} is on"))
    return out


def _ib_timeout(env: dict[str, str], rdma: bool, world: int | None, scale_ranks: int, min_at_scale: int) -> list[Hit]:
    if not rdma:
        return []
    raw = env.get("NCCL_IB_TIMEOUT")
    timeout = _int(raw)
    if raw is not None and timeout is None:
        return []
    at_scale = world is not None and world >= scale_ranks
    ms = f" (≈ {4.096e-6 * 2 ** (timeout if timeout is not None else IB_TIMEOUT_DEFAULT) * 1e3:.0f} ms per retry)"
    if timeout is not None and timeout < min_at_scale and at_scale:
        return [_hit("ib_timeout_low_at_scale", "NCCL_IB_TIMEOUT", raw,
                     f"NCCL_IB_TIMEOUT={timeout} is low for {world} ranks{ms}")]
    # Unset means NCCL's default: worth raising only where it bites (at scale); an explicit value below the seed's
    # is a choice someone made, and said so.
    if (timeout is not None and timeout < IB_TIMEOUT_SEED) or (timeout is None and at_scale):
        shown = f"NCCL_IB_TIMEOUT={timeout}" if timeout is not None else f"NCCL_IB_TIMEOUT unset ({IB_TIMEOUT_DEFAULT})"
        return [_hit("ib_timeout_default", "NCCL_IB_TIMEOUT", raw, f"{shown}, below the tuned {IB_TIMEOUT_SEED}{ms}",
                     severity="warning" if at_scale else None)]
    return []
