"""The DaemonSet's init step: the node's labels and its probe peers from the Kubernetes API, written as files.

The downward API gives a pod its own labels, not its node's, so the rack / leaf / spine labels a site or NVIDIA
Topograph puts on nodes must be read from the API. This writes them in the downward-API file format (``key="value"``
per line), which ``[topology] labels_file`` reads, and the GPU nodes' internal addresses as probe peers
(``name=address:port`` per line), which ``[sources.probes] peers_file`` reads. Standard library only: it runs in
the agent's image with the pod's service account (get and list on nodes, see docker/agent/daemonset.yaml).

Monitoring must never keep a node's agent from starting: an API that cannot be reached leaves empty files and a
line on stderr, and the step exits 0.

    python -m collectors.agent.kube --labels /run/clusterdx/labels --peers /run/clusterdx/peers
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def api_get(base: str, path: str, token: str, ca_file: str | None, timeout_s: float = 10.0) -> Any:
    context = ssl.create_default_context(cafile=ca_file) if base.startswith("https") else None
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}",
                                                           "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
        return json.load(answer)


def labels_text(labels: dict[str, str]) -> str:
    # json.dumps quotes as Go's %q does for the characters label values may hold ([A-Za-z0-9._-]).
    return "".join(f"{key}={json.dumps(value)}\n" for key, value in sorted(labels.items()))


def peers_text(nodes: list[dict[str, Any]], port: int) -> str:
    lines = []
    for node in nodes:
        name = node["metadata"]["name"]
        address = next((a["address"] for a in node.get("status", {}).get("addresses", [])
                        if a.get("type") == "InternalIP"), None)
        if address:
            host = f"[{address}]" if ":" in address else address
            lines.append(f"{name}={host}:{port}\n")
    return "".join(sorted(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collectors.agent.kube", description=__doc__.split("\n\n")[0])
    p.add_argument("--node", default=os.environ.get("NODE_NAME", ""), help="this node's name (default $NODE_NAME)")
    p.add_argument("--labels", help="write the node's labels here")
    p.add_argument("--peers", help="write the probe peers here")
    p.add_argument("--selector", default="nvidia.com/gpu.present=true", help="which nodes are peers")
    p.add_argument("--port", type=int, default=8651, help="the agents' probe port")
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    p.add_argument("--api", default=f"https://{host}:{port}" if host else "", help="the API server's URL")
    args = p.parse_args(argv)
    outputs = {"labels": args.labels, "peers": args.peers}
    texts = dict.fromkeys(outputs, "")
    try:
        token = (SERVICE_ACCOUNT / "token").read_text().strip() if (SERVICE_ACCOUNT / "token").exists() else ""
        ca = str(SERVICE_ACCOUNT / "ca.crt") if (SERVICE_ACCOUNT / "ca.crt").exists() else None
        if not args.api:
            raise OSError("not in a pod: KUBERNETES_SERVICE_HOST is not set and --api is not given")
        if args.labels:
            if not args.node:
                raise OSError("no node name: set NODE_NAME from spec.nodeName, or --node")
            node = api_get(args.api, f"/api/v1/nodes/{urllib.parse.quote(args.node)}", token, ca)
            texts["labels"] = labels_text(node["metadata"].get("labels", {}))
        if args.peers:
            query = urllib.parse.urlencode({"labelSelector": args.selector})
            texts["peers"] = peers_text(api_get(args.api, f"/api/v1/nodes?{query}", token, ca)["items"], args.port)
    except (OSError, ValueError, KeyError) as exc:
        print(f"clusterdx kube: {exc}; the agent starts without node labels / peers", file=sys.stderr)
    for key, path in outputs.items():
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(texts[key], encoding="utf-8")
    print(f"clusterdx kube: {texts['labels'].count(chr(10))} labels, {texts['peers'].count(chr(10))} peers",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
