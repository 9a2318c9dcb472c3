"""Findings for NCCL logs: the causes someone who has debugged these jobs would name, with the fix they'd try.

Each rule returns a :class:`Finding` or nothing; the report keeps the highest score as its verdict. Scores:
90+ the job certainly died of this, 60-89 likely cause, 20-59 a misconfiguration or slowness worth fixing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from clusterdx import nccl_rules
from collectors.doctor.nccl import IB_WC_STATUS, NCCL_RESULT
from collectors.doctor.report import Finding

if TYPE_CHECKING:
    from collectors.doctor.nccl import NcclFacts

_IB_CHECK = ("check both hosts' HCA ports (ibstat: State Active / LinkUp at the expected rate; perfquery or "
             "ibqueryerrors for SymbolErrors, LinkDowned, PortRcvErrors)")

# Completion status -> (score, cause, fix)
_IB_STATUS_FIX: dict[int, tuple[int, str, str]] = {
    12: (95, "transport retry counter exceeded: the peer's HCA stopped acknowledging - a flapping or congested "
         "link, a dead peer, or NCCL_IB_TIMEOUT too low for the fabric",
         _IB_CHECK + "; raise NCCL_IB_TIMEOUT (e.g. 22) and NCCL_IB_RETRY_CNT (7 is the maximum); if the same host "
         "or cable repeats, drain it"),
    13: (85, "RNR retry counter exceeded: the peer was not posting receives - it is stuck, slow or dead",
         "look at the peer rank's log and node first (hang, OOM, Xid); then " + _IB_CHECK),
    4: (85, "local protection error: a memory registration problem, usually GPUDirect RDMA",
        "check that the nvidia-peermem (or nv_peer_mem) module is loaded, ulimit -l is unlimited, and try "
        "NCCL_NET_GDR_LEVEL=LOC to confirm it is GDR"),
    10: (85, "remote access error: the peer refused the RDMA access (its memory registration is gone or wrong)",
         "the peer process probably died or reset its GPU - find the first error on the peer host; check "
         "nvidia-peermem there"),
    5: (55, "work request flushed: the queue pair was already in error, a consequence of an earlier failure",
        "find the first completion error or the first rank that died; this one is a knock-on effect"),
}


def _ib_completion(f: NcclFacts) -> Finding | None:
    if not f.ib_errors:
        return None
    # The most telling status wins: a flush (5) is only ever a consequence.
    ranked = sorted(f.ib_errors, key=lambda e: -_IB_STATUS_FIX.get(int(e["status"]), (70,))[0])
    first = ranked[0]
    status = int(first["status"])
    score, cause, fix = _IB_STATUS_FIX.get(status, (
        75, IB_WC_STATUS.get(status, "an unknown completion status"), _IB_CHECK))
    peer = f" (peer {first['peer']})" if first.get("peer") else ""
    peers = sorted({e["peer"] for e in f.ib_errors if e.get("peer")})
    spread = f"; {len(peers)} distinct peers reported" if len(peers) > 1 else ""
    return Finding(score, f"InfiniBand completion error {status}, vendor err {first['vendor_err']}{peer}: "
                   f"{cause}{spread}", fix, _warns(f, "completion"))


def _socket_fallback(f: NcclFacts) -> Finding | None:
    on_socket = f.network == "Socket" or "Socket" in f.transports or (
        f.ib_missing and f.socket_net and f.network is None)
    if not on_socket:
        return None
    ib_disable = f.env.get("NCCL_IB_DISABLE", "0").strip() not in ("0", "")
    forced = f.env.get("NCCL_NET", "").lower() == "socket"
    base = 60 if f.failed else 50
    if ib_disable or forced:
        what = "NCCL_IB_DISABLE=" + f.env["NCCL_IB_DISABLE"] if ib_disable else "NCCL_NET=Socket"
        return Finding(base - 10, f"NCCL runs over TCP sockets because {what} is set in the environment",
                       f"unset {what.split('=')[0]} unless this cluster really has no InfiniBand/RoCE; sockets are "
                       "several times slower for inter-node collectives")
    if f.plugin_failed:
        return Finding(base + 5, "NCCL fell back to TCP sockets: the network plugin failed to load "
                       f"({f.plugin_failed.strip()[:160]})",
                       "check NCCL_NET_PLUGIN and that the plugin library (and its libfabric/rdma-core "
                       "dependencies) is on LD_LIBRARY_PATH in the job's environment; then NCCL_IB_DISABLE")
    reason = "no usable IB device was found (NET/IB : No device found)" if f.ib_missing else "it found no RDMA network"
    return Finding(base + 5, f"NCCL fell back to TCP sockets: {reason}",
                   "check NCCL_IB_DISABLE / NCCL_NET_PLUGIN / the HCA: ibv_devinfo must list the HCA inside the job "
                   "(container: mount /dev/infiniband, install rdma-core/libibverbs), NCCL_IB_HCA must match it")


_WARN_RULES: tuple[tuple[tuple[str, ...], int, str, str], ...] = (
    (("Duplicate GPU detected",), 95, "two ranks were given the same GPU",
     "set CUDA_VISIBLE_DEVICES / torch.cuda.set_device(LOCAL_RANK) so each rank on a node gets its own GPU"),
    (("out of memory",), 90, "a CUDA allocation inside NCCL ran out of GPU memory",
     "leave headroom for NCCL buffers (smaller batch, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), or lower "
     "NCCL_BUFFSIZE / NCCL_NCHANNELS_PER_NET_PEER"),
    (("ibv_modify_qp", "ibv_create_qp", "ibv_reg_mr", "ibv_open_device"), 80,
     "an IB verbs call failed while setting up a connection",
     "RoCE: set NCCL_IB_GID_INDEX (usually 3) and check the GID table; ibv_reg_mr: raise ulimit -l to unlimited; "
     "check the HCA with ibv_devinfo"),
    (("NET/OFI",), 78, "the AWS OFI (libfabric/EFA) network plugin failed",
     "check that the EFA devices are visible in the job (fi_info -p efa; mount /dev/infiniband into the container) "
     "and that the aws-ofi-nccl and libfabric versions match the NCCL in use"),
    (("Connection refused", "connect to", "Connect to", "Call to connect", "No route to host"), 75,
     "a rank could not open a TCP connection to another one (bootstrap or socket transport)",
     "check NCCL_SOCKET_IFNAME picks an interface every node can reach (not docker0/lo), firewalls, and that "
     "MASTER_ADDR resolves to the same address on all nodes"),
    (("Connection closed by remote peer", "Connection reset by peer", "remote process exited"), 70,
     "a peer closed its connection: another rank died or was killed first",
     "this rank is a victim; find the first error on the peer host named in the warning (OOM, Xid, exception)"),
    (("Cuda failure", "CUDA failure", "cudaErrorIllegalAddress", "illegal memory access"), 80,
     "a CUDA error surfaced inside NCCL", "look for an Xid in dmesg on that node (13/31/43 = the program, "
     "48/79/94/95 = the GPU); rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel"),
    (("timeout", "Timeout", "timed out"), 65, "an NCCL operation timed out waiting for a peer",
     "find the slow or stuck rank (compare the ranks' last lines); check its node for Xid and its network port"),
)


def _warn_rules(f: NcclFacts) -> Finding | None:
    for needles, score, cause, fix in _WARN_RULES:
        hits = [w for w in f.warnings if any(n in w for n in needles)]
        if hits:
            return Finding(score, cause, fix, tuple(hits[:5]))
    return None


def _error_codes(f: NcclFacts) -> Finding | None:
    if not f.error_codes:
        return None
    code = 6 if 6 in f.error_codes else max(f.error_codes, key=f.error_codes.__getitem__)
    name = NCCL_RESULT.get(code, f"error {code}")
    if code == 6:
        return Finding(72, f"NCCL reported {name}: a remote rank failed or its connection broke",
                       "this rank is a victim; the first WARN on another host (often a completion error or a dead "
                       "process) is the cause", _warns(f, ""))
    if code == 1:
        return Finding(78, f"NCCL reported {name}: a CUDA call failed",
                       "check dmesg for an Xid on that node and the CUDA error printed just before", _warns(f, ""))
    return Finding(60, f"NCCL failed with {name}", "read the first WARN line (below): it names the call that "
                   "failed; rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET for more", _warns(f, ""))


def _generic_failure(f: NcclFacts) -> Finding | None:
    if not f.failed:
        return None
    first = next(iter(f.warnings), "")
    what = f": {first.split('WARN', 1)[-1].strip()[:200]}" if first else ""
    return Finding(45, f"NCCL reported a failure{what}", "start from the earliest WARN across all ranks' logs; the "
                   "other ranks usually only report the consequence", _warns(f, ""))


def _env_drift(f: NcclFacts) -> Finding | None:
    if not f.env_drift:
        return None
    name, values = next(iter(f.env_drift.items()))
    return Finding(40, f"NCCL settings differ between ranks ({name}: {', '.join(sorted(values))})",
                   "launch every rank with the same NCCL_* environment; mismatches cause hangs and slow paths")


def _no_gdr(f: NcclFacts) -> Finding | None:
    if f.gdr() is False and any(t not in ("Socket",) for t in f.transports) and "IB" in f.transports:
        return Finding(25, "InfiniBand is used without GPUDirect RDMA: traffic is staged through host memory",
                       "load nvidia-peermem (lsmod | grep peermem), check the GPU-HCA PCIe distance "
                       "(nvidia-smi topo -m) and NCCL_NET_GDR_LEVEL")
    return None


_AUDIT_SCORE = {"error": 55, "warning": 35, "info": 20}
_NO_IFACE = ("no socket interface found", "No usable listening interface", "no interface found")


def _settings_audit(f: NcclFacts) -> list[Finding]:
    """The live diagnosis' NCCL rule table (clusterdx.nccl_rules) on the environment the log printed. The HCAs and
    interfaces NCCL listed are the ones it selected, so a name that matches nothing shows as its consequence: "NET/IB
    : No device found" with NCCL_IB_HCA set, or a "no socket interface found" warning with NCCL_SOCKET_IFNAME set.
    NCCL_DEBUG is left out: a log to read was made with INFO on purpose."""
    fabric = f.fabric() or ("ib" if f.network == "IB" else None)
    hits = [h for h in nccl_rules.audit(f.env, interconnect=fabric, world_size=f.nranks) if h.rule != "debug_verbose"]
    hca = f.env.get("NCCL_IB_HCA")
    if hca and f.ib_missing:
        rule = nccl_rules.RULES["ib_hca_missing"]
        hits.append(nccl_rules.Hit(rule.name, rule.severity, "NCCL_IB_HCA", hca,
                                   f"NCCL_IB_HCA={hca} and NCCL found no IB device", rule.reason, rule.fix))
    ifname = f.env.get("NCCL_SOCKET_IFNAME")
    missing = [w for w in f.warnings if any(n in w for n in _NO_IFACE)]
    if ifname and missing:
        rule = nccl_rules.RULES["socket_ifname_missing"]
        hits.append(nccl_rules.Hit(rule.name, rule.severity, "NCCL_SOCKET_IFNAME", ifname,
                                   f"NCCL_SOCKET_IFNAME={ifname} matched no interface", rule.reason, rule.fix))
    return [Finding(_AUDIT_SCORE.get(h.severity, 20), f"{h.title}: {h.reason}", h.fix,
                    tuple(missing[:5]) if h.rule == "socket_ifname_missing" else ()) for h in hits]


def _no_interface(f: NcclFacts) -> Finding | None:
    hits = [w for w in f.warnings if any(n in w for n in _NO_IFACE)]
    if not hits:
        return None
    return Finding(85, "NCCL found no usable network interface for its bootstrap / socket transport",
                   "set NCCL_SOCKET_IFNAME to an interface every node has (ip -br addr; a prefix such as 'ens' "
                   "matches several, '=' makes it exact) and check the container sees the host network", tuple(hits[:5]))


RULES: tuple[Callable[[NcclFacts], Finding | None], ...] = (
    _ib_completion, _no_interface, _warn_rules, _error_codes, _socket_fallback, _generic_failure, _env_drift, _no_gdr,
)


def nccl_findings(f: NcclFacts) -> list[Finding]:
    return [found for rule in RULES if (found := rule(f)) is not None] + _settings_audit(f)


def _warns(f: NcclFacts, needle: str) -> tuple[str, ...]:
    return tuple(w for w in f.warnings if needle in w)[:5]
