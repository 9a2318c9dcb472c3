"""The agent's place from where a site keeps it: its Kubernetes node labels (the file the DaemonSet's init step writes,
from a stand-in API server here) and Slurm's topology.conf, each below ``[topology]``'s own values and the
environment; and the shipped DaemonSet's config is one the agent accepts, probes on."""

from __future__ import annotations

import json
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from collectors.agent import kube, registry
from collectors.agent.config import ConfigError, build

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "topology"
SOURCES = tuple(registry.SOURCES)
BASE = {"server": "https://dx.example", "token_file": "/etc/clusterdx/token"}


def topology(table: dict[str, Any], host: str = "gpu-017", **environ: str) -> dict[str, str]:
    return build({**BASE, "host": host, "topology": table}, {}, SOURCES, environ=environ).topology


def test_the_node_labels_file_places_the_node_and_the_config_and_environment_win() -> None:
    labels = str(FIX / "node-labels")
    assert topology({"labels_file": labels}) == {"rack": "r17", "switch": "leaf02", "spine": "spine1"}
    assert topology({"labels_file": labels, "rack": "rack-17"}, CLUSTERDX_SPINE="spine-9") == {
        "rack": "rack-17", "switch": "leaf02", "spine": "spine-9"}


def test_slurm_topology_conf_is_looked_up_by_the_host_name() -> None:
    conf = str(FIX / "tree-topology.conf")
    assert topology({"slurm_topology": conf}, host="gpu033") == {"switch": "leaf03", "spine": "spine2"}
    assert topology({"slurm_topology": conf}, host="gpu033.cluster.example") == {"switch": "leaf03", "spine": "spine2"}
    assert topology({"slurm_topology": conf}, host="login1") == {}  # a node the file does not list: not known


def test_a_missing_or_bad_file_stops_the_agent_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "labels"
    bad.write_text("NodeName=gpu[001-040] CPUs=128 Gres=gpu:8\n")  # a slurm.conf line, not a topology
    with pytest.raises(ConfigError) as info:
        topology({"labels_file": str(tmp_path / "none"), "slurm_topology": str(bad), "label_file": "x"})
    assert info.value.problems == [
        f"topology.labels_file: cannot read {tmp_path / 'none'} (No such file or directory)",
        f"topology.slurm_topology: {bad}: line 1: expected SwitchName=..., BlockName=... or BlockSizes=..., "
        "got 'NodeName=gpu[001-040] CPUs=128 Gres=gpu:8'",
        "topology.label_file: unknown option; did you mean 'labels_file'?",
    ]


class _FakeApi(BaseHTTPRequestHandler):
    """Stands in for the Kubernetes API server (none runs here): the two reads the init step makes."""

    nodes = [{"metadata": {"name": name, "labels": {"network.topology.nvidia.com/leaf": f"leaf-{i // 2}",
                                                     "topology.kubernetes.io/rack": f"rack-{i // 2}"}},
              "status": {"addresses": [{"type": "Hostname", "address": name},
                                       {"type": "InternalIP", "address": f"10.0.0.{i + 1}"}]}}
             for i, name in enumerate(["gpu-0", "gpu-1", "gpu-2"])]
    def do_GET(self) -> None:
        if self.path == "/api/v1/nodes?labelSelector=nvidia.com%2Fgpu.present%3Dtrue":
            body: Any = {"items": self.nodes}
        else:
            body = next((n for n in self.nodes if self.path == f"/api/v1/nodes/{n['metadata']['name']}"), None)
        data = json.dumps(body).encode()
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_init_step_writes_the_labels_and_peers_the_agent_reads(api: str, tmp_path: Path) -> None:
    labels, peers = tmp_path / "labels", tmp_path / "peers"
    assert kube.main(["--api", api, "--node", "gpu-2", "--labels", str(labels), "--peers", str(peers)]) == 0
    assert peers.read_text() == "gpu-0=10.0.0.1:8651\ngpu-1=10.0.0.2:8651\ngpu-2=10.0.0.3:8651\n"
    assert topology({"labels_file": str(labels)}, host="gpu-2") == {"rack": "rack-1", "switch": "leaf-1"}
    # An API that does not know the node: empty files, exit 0, the agent starts without a place.
    assert kube.main(["--api", api, "--node", "gone", "--labels", str(labels), "--peers", str(peers)]) == 0
    assert labels.read_text() == "" and topology({"labels_file": str(labels)}) == {}


def test_the_shipped_daemonset_config_turns_probes_on_and_reads_the_labels(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((REPO / "docker/agent/daemonset.yaml").read_text()))
    raw = tomllib.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["agent.toml"])
    assert raw["sources"]["probes"]["enabled"] is True and raw["sources"]["probes"]["peers_file"].startswith("/run/")
    raw["topology"]["labels_file"] = str(FIX / "node-labels")  # where the init step writes it, here
    assert build(raw, {}, SOURCES, environ={}).topology["switch"] == "leaf02"
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][:3] == ["python", "-m", "collectors.agent.kube"]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/run/clusterdx"}
