"""The one line of evidence that matters, per finding kind ("compute 1.32x median, z=9.1"): what a list row or an
alert shows next to the title. Pure: it reads only the finding's stored evidence, so every live row can carry it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ratio(a: Any, b: Any) -> float | None:
    a, b = _num(a), _num(b)
    return a / b if a is not None and b not in (None, 0) else None


def _join(*parts: str | None) -> str:
    return ", ".join(p for p in parts if p)


def _z(m: dict[str, Any]) -> str | None:
    return f"z={m['z']:g}" if _num(m.get("z")) is not None else None


def _straggler(m: dict[str, Any], e: dict[str, Any]) -> str:
    r = _ratio(m.get("compute_s"), m.get("median_compute_s"))
    gpu = m.get("gpu") or {}
    clock = f"SM clock {gpu['clock_ratio']:.0%}" if _num(gpu.get("clock_ratio")) is not None else None
    return _join(f"compute {r:.2f}x median" if r is not None else None, _z(m), clock)


def _starvation(m: dict[str, Any], e: dict[str, Any]) -> str:
    share = _num(m.get("data_wait_share"))
    wait, med = _num(m.get("data_wait_s")), _num(m.get("median_data_wait_s"))
    return _join(f"data wait {share:.0%} of each step" if share is not None else None,
                 f"{wait:.3g} s vs median {med:.3g} s" if wait is not None and med is not None else None, _z(m))


def _throttling(m: dict[str, Any], e: dict[str, Any]) -> str:
    r, temp = _num(m.get("clock_ratio")), _num(m.get("temp_c"))
    return _join(f"SM clock {r:.0%} of max" if r is not None else None, f"{temp:.0f} °C" if temp is not None else None,
                 ", ".join(m.get("reasons") or []) or None)


def _failing_gpu(m: dict[str, Any], e: dict[str, Any]) -> str:
    """The counters that moved, worst first; the detector's own words when none did (a lost GPU)."""
    sbe, rate = _num(m.get("ecc_sbe_delta")), _num(m.get("ecc_sbe_per_s"))
    parts = [
        "GPU lost" if m.get("lost") else None, "row remap failed" if m.get("remap_failure") else None,
        f"DBE {m['ecc_dbe_volatile']:g}" if _num(m.get("ecc_dbe_volatile")) else None,
        f"Xid {m['xid']}" if m.get("xid") is not None else None,
        f"SBE +{sbe:g}" + (f" ({rate:g}/s)" if rate is not None else "") if sbe else None,
        "remap pending" if m.get("remap_pending") else None,
        f"{m['pcie_replays']:g} PCIe replays" if _num(m.get("pcie_replays")) else None,
        f"{m['nvlink_errors']:g} NVLink errors" if _num(m.get("nvlink_errors")) else None,
        f"NVLink {m['nvlink_links_up']:g} links up" if _num(m.get("nvlink_links_up")) is not None else None,
        f"PCIe Gen{m['pcie_gen']:g} x{m['pcie_width']:g}" if _num(m.get("pcie_gen")) is not None
        and _num(m.get("pcie_width")) is not None else None,
    ]
    problems = e.get("problems") or []
    return _join(*parts) or (str(problems[0]) if problems else "")


def _slow_link(m: dict[str, Any], e: dict[str, Any]) -> str:
    if "port" in m:
        errors = sum(v for v in (m.get("errors") or {}).values() if _num(v) is not None)
        return _join(f"IB port {m['port']}", f"{errors:.0f} link errors" if errors else None,
                     f"{m['rate_gbps']:g} Gb/s" if _num(m.get("rate_gbps")) is not None else None)
    rtt_x = _ratio(m.get("rtt_ms"), m.get("baseline_rtt_ms"))
    bw_x = _ratio(m.get("bw_gbps"), m.get("baseline_bw_gbps"))
    loss = _num(m.get("loss"))
    return _join(f"RTT {m['rtt_ms']:.2f} ms ({rtt_x:.1f}x quiet)" if rtt_x is not None else None,
                 f"loss {loss:.0%}" if loss else None,
                 f"bandwidth {bw_x:.0%} of cluster" if bw_x is not None and bw_x < 1 else None)


def _node_down(m: dict[str, Any], e: dict[str, Any]) -> str:
    silent, loss = _num(m.get("silent_s")), _num(m.get("probe_loss"))
    ranks = len(m.get("ranks") or [])
    return _join(f"silent {silent:.0f} s" if silent is not None else None,
                 f"probe loss {loss:.0%}" if loss is not None else None, f"{ranks} rank(s) stopped" if ranks else None)


def _cluster_silent(m: dict[str, Any], e: dict[str, Any]) -> str:
    silent, nodes, lag = _num(m.get("silent_s")), _num(m.get("nodes")), _num(m.get("ingest_lag_s"))
    return _join(f"silent {silent:.0f} s" if silent is not None else None,
                 f"all {nodes:,.0f} nodes" if nodes is not None else None,
                 f"batches arrive {lag:.0f} s late" if lag is not None and lag >= 1 else None)


def _clock_skew(m: dict[str, Any], e: dict[str, Any]) -> str:
    behind, spread = _num(m.get("behind_s")), _num(m.get("delay_spread_s"))
    return _join(f"clock {behind:.0f} s behind" if behind is not None else None,
                 f"steady within {spread:.1f} s" if spread is not None else None)


def _stall(m: dict[str, Any], e: dict[str, Any]) -> str:
    stalled, med = _num(m.get("stalled_s")), _num(m.get("median_step_s"))
    silent = _num(m.get("silent_s"))
    state = f"{m['state']}, no beat for {silent:.0f} s" if m.get("state") and silent is not None else m.get("state")
    x = f" ({stalled / med:.0f}x median step)" if stalled is not None and med else ""
    return _join(state, f"no step for {stalled:.0f} s{x}" if stalled is not None else None)


def _memory(m: dict[str, Any], e: dict[str, Any]) -> str:
    a, r = _num(m.get("allocated_frac")), _num(m.get("reserved_frac"))
    return _join(f"{a:.0%} allocated" if a is not None else None, f"{r:.0%} reserved" if r is not None else None)


def _checkpoint(m: dict[str, Any], e: dict[str, Any]) -> str:
    usd, since = _num(m.get("usd_at_risk")), m.get("steps_since")
    return _join(f"{since} steps since the last checkpoint" if since is not None else None,
                 f"${usd:,.0f} at risk" if usd is not None else None)


def _nccl(m: dict[str, Any], e: dict[str, Any]) -> str:
    if "NCCL_IB_TIMEOUT" in m:
        return f"NCCL_IB_TIMEOUT={m['NCCL_IB_TIMEOUT']} at {m.get('world_size')} ranks"
    diffs = m.get("differences") or {}
    if diffs:
        var = sorted(diffs)[0]
        d = diffs[var] or {}
        return f"{var}={d.get('value')} (others {d.get('others')})" + (f" +{len(diffs) - 1}" if len(diffs) > 1 else "")
    return str((m.get("facts") or [""])[0])


def _efficiency(m: dict[str, Any], e: dict[str, Any]) -> str:
    mfu, tps = _num(m.get("mfu")), _num(m.get("tokens_per_s"))
    return _join(f"MFU {mfu:.1%}" if mfu is not None else None, f"{tps:,.0f} tokens/s" if tps is not None else None)


LINES: dict[str, Callable[[dict[str, Any], dict[str, Any]], str]] = {
    "straggler": _straggler, "data_starvation": _starvation, "throttling": _throttling, "failing_gpu": _failing_gpu,
    "slow_link": _slow_link, "node_down": _node_down, "cluster_silent": _cluster_silent, "clock_skew": _clock_skew,
    "rank_down": _stall, "hang": _stall, "memory_pressure": _memory,
    "checkpoint_overdue": _checkpoint, "nccl_config": _nccl, "efficiency": _efficiency,
}


def headline(finding: Any) -> str:
    """The finding's deciding numbers in one line; its title when the evidence has none (never raises: a row in a
    live frame must not fail over an odd evidence dict)."""
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    metrics = evidence.get("metrics") if isinstance(evidence.get("metrics"), dict) else {}
    try:
        text = LINES[finding.kind](metrics, evidence) if finding.kind in LINES else ""
    except (KeyError, TypeError, ValueError):
        text = ""
    return text or finding.title
