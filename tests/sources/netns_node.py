"""One node of the network-namespace probe test, run inside a namespace with ``ip netns exec``.

``serve HOST PORT``: run the probe responder until stdin closes (prints "ready" once listening).
``probe JSON``: run a ProbeSource with these options until every peer had a bulk transfer (or 15 s passed), then
print every Probe record it reported as one JSON list.
"""

from __future__ import annotations

import json
import sys
import time

from collectors.agent.source import Collected
from collectors.sources.probe_responder import Responder
from collectors.sources.probes import ProbeSource


def serve(host: str, port: int) -> None:
    responder = Responder(host, port)
    responder.start()
    print("ready", flush=True)
    sys.stdin.read()
    responder.stop()


def probe(options: dict[str, object]) -> None:
    source = ProbeSource(**options)  # type: ignore[arg-type]
    assert source.start() is None
    peers = {p.label for p in source.peers()}
    records: list[dict[str, object]] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        out = Collected()
        source.collect(time.time(), out)
        records.extend(out.probes)
        if peers <= {r["peer"] for r in records if r.get("bw_gbps") is not None}:
            break
        time.sleep(0.02)
    source.close()
    print(json.dumps(records), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        probe(json.loads(sys.argv[2]))
