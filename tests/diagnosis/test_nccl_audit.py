"""The NCCL settings audit (clusterdx.nccl_rules) in the pure detector: each rule fires on its case, with the seed's
reason and the fix, and stays quiet on the tuned, healthy configuration; the socket fallback is held for the run."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from clusterdx import nccl_rules
from dashboard.diagnosis.detectors.base import Detection, Thresholds
from dashboard.diagnosis.detectors.nccl import nccl_config
from dashboard.diagnosis.detectors.window import (
    GPU_NUM,
    GPU_OBJ,
    PORT_NUM,
    PORT_OBJ,
    PROBE_NUM,
    STEP_NUM,
    RankInfo,
    RunInfo,
    Table,
    Window,
)
from tests.server import conftest as server
from tests.server.conftest import World, make_batch, post

world = server.world  # the server tests' database fixture (a cluster, its token and members), used by the last test

NOW = 10_000.0
NODES = ["node-001", "node-002"]
# What the seed tunes for an IB cluster: nothing here may fire.
HEALTHY = {"NCCL_IB_HCA": "mlx5", "NCCL_IB_TIMEOUT": "22", "NCCL_SOCKET_IFNAME": "ens", "NCCL_DEBUG": "WARN"}


def window(env: dict[str, str], *, size: int = 16, interconnect: str = "ib", events: list[dict[str, Any]] | None = None,
           held: list[dict[str, Any]] | None = None, devices: tuple[str, ...] = ("mlx5_0", "mlx5_1"),
           node_env: dict[str, dict[str, str]] | None = None) -> Window:
    ranks = {}
    for r in range(4):
        node = NODES[r // 2]
        ranks[r] = RankInfo(node, r % 2, {"env": dict((node_env or {}).get(node, env))})
    run = RunInfo("job-1", size, {}, ranks, last_step=10, last_step_ts=NOW - 1)
    ports = Table.from_rows(PORT_NUM, PORT_OBJ, [(float(i), NOW - 1, 1.0, 400.0, 0.0, dev, "Active", {})
                                                 for i in range(len(NODES)) for dev in devices])
    w = Window(now=NOW, nodes=NODES, steps=Table.from_rows(STEP_NUM, (), []), gpus=Table.from_rows(GPU_NUM, GPU_OBJ, []),
               ports=ports, probes=Table.from_rows(PROBE_NUM, (), []), events=events or [], hosts={}, runs=[run],
               last_heard={}, interconnect=interconnect)
    w.nccl_state = held or []
    return w


def nccl(ts: float, node: str, **data: str) -> dict[str, Any]:
    return {"ts": ts, "node": node, "kind": "nccl", "severity": "info", "message": "", "data": data}


def rules_of(found: list[Detection], subject: str) -> list[str]:
    det = next((d for d in found if d.subject == subject), None)
    return [r["rule"] for r in det.evidence["metrics"].get("rules", [])] if det else []


def test_it_stays_quiet_on_the_tuned_configuration() -> None:
    assert nccl_config(window(HEALTHY), Thresholds()) == []
    assert nccl_rules.audit(HEALTHY, interconnect="ib", world_size=4096, hcas=["mlx5_0"], interfaces=["ens1f0"]) == []


CASES = [
    # (rule, env changes, window options)
    ("ib_timeout_default", {"NCCL_IB_TIMEOUT": "20"}, {}),
    ("ib_timeout_default", {"NCCL_IB_TIMEOUT": None}, {"size": 1024}),
    ("ib_timeout_low_at_scale", {"NCCL_IB_TIMEOUT": "14"}, {"size": 1024}),
    ("ib_retry_cnt_low", {"NCCL_IB_RETRY_CNT": "3"}, {}),
    ("p2p_disabled", {"NCCL_P2P_DISABLE": "1"}, {}),
    ("shm_disabled", {"NCCL_SHM_DISABLE": "1"}, {}),
    ("algo_forced", {"NCCL_ALGO": "Ring"}, {}),
    ("proto_forced", {"NCCL_PROTO": "Simple"}, {}),
    ("debug_verbose", {"NCCL_DEBUG": "INFO"}, {}),
    ("gid_index_unset_roce", {}, {"interconnect": "roce"}),
]


@pytest.mark.parametrize(("rule", "changes", "opts"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_fires_on_the_run_with_its_reason_and_fix(rule: str, changes: dict[str, str | None],
                                                            opts: dict[str, Any]) -> None:
    env = {k: v for k, v in {**HEALTHY, **changes}.items() if v is not None}
    found = nccl_config(window(env, **opts), Thresholds())
    assert rules_of(found, "job-1") == [rule]
    det = found[0]
    spec = nccl_rules.RULES[rule]
    assert (det.kind, det.subject_type, det.run) == ("nccl_config", "run", "job-1")
    assert spec.reason in det.action and spec.fix in det.action
    assert det.severity == ("warning" if opts.get("size", 0) >= 512 else spec.severity)


def test_the_default_timeout_left_unset_is_not_flagged_below_scale() -> None:
    env = {k: v for k, v in HEALTHY.items() if k != "NCCL_IB_TIMEOUT"}
    assert nccl_config(window(env, size=64), Thresholds()) == []


def test_roce_is_also_read_from_the_hcas_nccl_listed() -> None:
    roce = [nccl(NOW - 5, "node-001", fact="net_devices", devices="mlx5_0:1 mlx5_1:1", links="RoCE", oob="ens1f0")]
    assert rules_of(nccl_config(window(HEALTHY, events=roce), Thresholds()), "job-1") == ["gid_index_unset_roce"]
    tuned = {**HEALTHY, "NCCL_IB_GID_INDEX": "3"}
    assert nccl_config(window(tuned, events=roce), Thresholds()) == []


def test_an_hca_the_node_does_not_have_is_named_with_the_ones_it_has() -> None:
    env = {**HEALTHY, "NCCL_IB_HCA": "=mlx5_4,mlx5_5"}
    found = nccl_config(window(env, node_env={"node-002": env, "node-001": HEALTHY}), Thresholds())
    assert [d.subject for d in found] == ["node-002"]
    assert rules_of(found, "node-002") == ["ib_hca_missing"] and found[0].severity == "error"
    assert "mlx5_0, mlx5_1" in found[0].title


def test_a_socket_ifname_the_node_does_not_have_is_named_with_its_real_interfaces() -> None:
    env = {**HEALTHY, "NCCL_SOCKET_IFNAME": "=eth0"}
    seen = [nccl(NOW - 5, "node-001", fact="net_devices", devices="mlx5_0:1", links="IB", oob="ens1f0"),
            nccl(NOW - 5, "node-001", fact="interfaces", interfaces="ens1f0 ens1f1")]
    found = nccl_config(window(env, events=seen), Thresholds())
    assert rules_of(found, "node-001") == ["socket_ifname_missing"]
    assert "ens1f0, ens1f1" in found[0].title
    # node-002's interfaces are unknown (the agent reports none): no guess.
    assert "node-002" not in [d.subject for d in found]


def test_nccls_own_no_interface_warning_names_the_setting() -> None:
    env = {**HEALTHY, "NCCL_SOCKET_IFNAME": "eht0"}
    warn = [nccl(NOW - 5, "node-002", fact="warn", warn="Bootstrap : no socket interface found")]
    found = nccl_config(window(env, events=warn), Thresholds())
    assert rules_of(found, "node-002") == ["socket_ifname_missing"]
    assert "no socket interface found" in found[0].title and "agent reports no interface names" in found[0].title


def test_a_socket_fallback_is_held_for_the_run_until_the_ranks_report_ib() -> None:
    old = [nccl(NOW - 3600, "node-002", fact="transport", transport="Socket")]
    found = nccl_config(window(HEALTHY, held=old), Thresholds())
    assert [(d.subject, d.severity) for d in found] == [("node-002", "error")], "an hour later, still on sockets"
    back = [*old, nccl(NOW - 1800, "node-002", fact="transport", transport="IB", gdr="true")]
    assert nccl_config(window(HEALTHY, held=back), Thresholds()) == [], "the ranks reported IB again"
    # Intra-node transports say nothing about the network.
    p2p = [*old, nccl(NOW - 1800, "node-002", fact="transport", transport="P2P/IPC")]
    assert [d.subject for d in nccl_config(window(HEALTHY, held=p2p), Thresholds())] == ["node-002"]


def test_an_ethernet_cluster_gets_no_socket_fallback_error() -> None:
    socket = [nccl(NOW - 5, "node-002", fact="network", network="Socket")]
    assert nccl_config(window(HEALTHY, interconnect="eth", events=socket), Thresholds()) == []


def test_the_device_list_syntax_follows_nccl() -> None:
    have = ["mlx5_0", "mlx5_1", "mlx5_10"]
    assert nccl_rules.selects("mlx5_1", have) == ["mlx5_1", "mlx5_10"]  # a prefix
    assert nccl_rules.selects("=mlx5_1:1", have) == ["mlx5_1"]
    assert nccl_rules.selects("^mlx5_1", have) == ["mlx5_0"]
    assert nccl_rules.selects("^=mlx5_0,mlx5_1", have) == ["mlx5_10"]


@pytest.mark.django_db
def test_the_loader_holds_a_runs_socket_fallback_past_the_event_window(world: World, client: Any) -> None:
    """Through the database: an agent's one "via NET/Socket" event from ten minutes ago (outside the 120 s event
    window) still names the node while the run is active; a later NET/IB event ends it."""
    from dashboard.diagnosis.loader import load_window
    from dashboard.telemetry import interconnect
    from dashboard.telemetry.models import Event, Node, Run

    interconnect.clear_cache()
    port = {"ts": time.time(), "device": "mlx5_0", "port": 1, "link_layer": "InfiniBand", "state": "Active"}
    assert post(client, make_batch(0, host="node-001", ports=[port]), world.token).status_code == 200
    node = Node.objects.get(cluster=world.cluster, hostname="node-001")
    began = time.time() - 600
    Run.objects.filter(cluster=world.cluster).update(created_at=datetime.fromtimestamp(began - 10, UTC))

    def event(ts: float, **data: str) -> None:
        Event.objects.create(cluster=world.cluster, node=node, ts=datetime.fromtimestamp(ts, UTC), kind="nccl",
                             severity="info", message="", data={**data, "host": "node-001"})

    event(began, fact="transport", transport="Socket")
    event(began, fact="warn", warn="an old warning is not state")
    event(began - 3600, fact="transport", transport="Socket")  # before the run began: not read
    w = load_window(world.cluster, time.time(), beats=[])
    assert [e["data"]["fact"] for e in w.nccl_state] == ["transport"]
    assert [(d.subject, d.severity) for d in nccl_config(w, Thresholds())] == [("node-001", "error")]
    event(began + 300, fact="transport", transport="IB", gdr="true")
    assert nccl_config(load_window(world.cluster, time.time(), beats=[]), Thresholds()) == []
