"""A :class:`Window` fed straight from wire batches, with the same spans and row layouts as the database loader.

The fault-injection suite and the pure tests push simulator batches through it, so detectors see exactly what they
would see through ingest and :mod:`dashboard.diagnosis.loader`, without a database.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from dashboard.diagnosis.detectors.nccl import share_env
from dashboard.diagnosis.detectors.window import (
    GPU_NUM,
    GPU_OBJ,
    LOSS_SPAN,
    PORT_NUM,
    PORT_OBJ,
    PROBE_NUM,
    SPANS,
    STEP_NUM,
    STEP_OBJ,
    STEP_SPAN,
    RankInfo,
    RunInfo,
    Table,
    Window,
    bus_key,
    port_suspect,
)

# Run-wide facts copied from a rank's RunMeta, as the ingest writer does.
RUN_WIDE = ("versions", "parallel", "flops_per_token", "peak_flops", "dtype", "params", "gpu_name",
            "last_checkpoint_step", "last_checkpoint_ts")


class WindowBuffer:
    def __init__(self, interconnect: str = "ib") -> None:
        self.interconnect = interconnect
        self.nodes: dict[str, int] = {}
        self.runs: dict[str, RunInfo] = {}
        self.run_index: dict[str, int] = {}
        self.gpus: deque[tuple[Any, ...]] = deque()
        self.ports: deque[tuple[Any, ...]] = deque()
        self.probes: deque[tuple[Any, ...]] = deque()
        self.steps: deque[tuple[Any, ...]] = deque()
        self.events: deque[dict[str, Any]] = deque()
        self.hosts: dict[str, dict[str, Any]] = {}
        self.last_heard: dict[str, float] = {}
        self.sent: dict[str, float] = {}  # host -> its newest batch's sent_at
        self.post_interval: dict[str, float] = {}
        self.gpu_bus: dict[tuple[str, str], int] = {}
        self.beats: dict[tuple[str, int], dict[str, Any]] = {}  # (run, rank) -> latest beat, as the live state
        self.places: dict[str, tuple[str, str]] = {}  # host -> (rack, switch), as the ingest writer stores them
        self.losses: dict[str, dict[int, tuple[int, float, float]]] = {}  # run -> step -> (rank, ts, loss)
        self._envs: dict[Any, Any] = {}  # the ranks' environments, one dict each (nccl.share_env)

    def _node(self, host: str) -> int:
        if host not in self.nodes:
            self.nodes[host] = len(self.nodes)
        return self.nodes[host]

    def _run(self, name: str) -> int:
        if name not in self.runs:
            self.run_index[name] = len(self.runs)
            self.runs[name] = RunInfo(name, None, {}, {})
        return self.run_index[name]

    def add(self, batch: dict[str, Any]) -> None:
        host = batch["host"]
        n = self._node(host)
        heard = batch.get("sent_at", 0.0)
        prev = self.sent.get(host)
        if heard and (prev is None or heard > prev):  # a replayed older batch says nothing of the cadence
            if prev is not None:
                self.post_interval[host] = heard - prev
            self.sent[host] = heard
        top = batch.get("topology") or {}
        if top.get("rack") or top.get("switch"):  # a part left out keeps what was known, as the writer does
            rack, switch = self.places.get(host, ("", ""))
            self.places[host] = (top.get("rack") or rack, top.get("switch") or switch)
        for g in batch.get("gpus", []):
            self.gpus.append((n, g["index"], g["ts"], *(g.get(c) for c in GPU_NUM[3:]),
                              *(g.get(c) for c in GPU_OBJ)))
            key = bus_key(g.get("pci_bus_id"))
            if key:
                self.gpu_bus[(host, key)] = g["index"]
        for p in batch.get("ports", []):
            self.ports.append((n, p["ts"], p["port"], p.get("rate_gbps"), port_suspect(p.get("state"), p.get("counters")),
                               p["device"], p.get("state"), p.get("counters")))
        for p in batch.get("probes", []):
            self.probes.append((n, self._node(p["peer"]), p["ts"], p["sent"], p["lost"], p.get("rtt_ms"),
                                p.get("bw_gbps")))
        for h in batch.get("hosts", []):
            self.hosts[host] = {"ts": h["ts"], "cpu_pct": h.get("cpu_pct"), "nfs": h.get("nfs")}
        for meta in batch.get("runs", []):
            self._meta(host, meta)
        for s in batch.get("steps", []):
            ri = self._run(s["run"])
            self.steps.append((ri, *(s.get(c) for c in STEP_NUM[1:]), *(s.get(c) for c in STEP_OBJ)))
            loss = (s.get("metrics") or {}).get("loss")
            if loss is not None:
                seen = self.losses.setdefault(s["run"], {})
                if s["step"] not in seen or s["rank"] < seen[s["step"]][0]:  # the lowest rank's, as the loader reads
                    seen[s["step"]] = (s["rank"], s["ts"], float(loss))
            run = self.runs[s["run"]]
            if run.last_step_ts is None or s["ts"] > run.last_step_ts:
                run.last_step, run.last_step_ts = s["step"], s["ts"]
        for e in batch.get("events", []):
            ev = {"ts": e["ts"], "node": host, "kind": e["kind"], "severity": e.get("severity", "info"),
                  "code": e.get("code"), "gpu_index": e.get("gpu_index"), "pci_bus_id": e.get("pci_bus_id"),
                  "run": e.get("run"), "rank": e.get("rank"), "step": e.get("step"),
                  "message": e.get("message", ""), "data": e.get("data")}
            if e["kind"] == "checkpoint" and e.get("run") in self.runs and e.get("step") is not None:
                ckpts = self.runs[e["run"]].checkpoints
                # Every node reports the same checkpoint: keep one entry per step, as the loader's GROUP BY does.
                if not any(step == e["step"] for _, step in ckpts[-8:]):
                    ckpts.append((e["ts"], e["step"]))
            self.events.append(ev)
        for b in batch.get("beats", []):
            # "received" is the server's clock in the live state; the batch's send time stands in for it here.
            self.beats[(b["run"], b["rank"])] = {**b, "host": host, "received": heard or b["ts"]}
        stamps = [r["ts"] for key in ("gpus", "hosts", "ports", "probes") for r in batch.get(key, [])]
        self.last_heard[host] = max(stamps) if stamps else heard

    def _meta(self, host: str, meta: dict[str, Any]) -> None:
        self._run(meta["run"])
        run = self.runs[meta["run"]]
        stable = share_env({k: v for k, v in meta.items() if k != "ts"}, self._envs)
        run.ranks[meta["rank"]] = RankInfo(meta.get("host") or host, meta.get("gpu_index"), stable)
        run.world_size = meta["world_size"]
        run.meta.update({k: meta[k] for k in RUN_WIDE if meta.get(k) is not None})

    def _trim(self, now: float) -> None:
        for rows, span, ts_at in ((self.gpus, SPANS["gpus"], 2), (self.ports, SPANS["ports"], 1),
                                  (self.probes, SPANS["probes"], 2)):
            while rows and rows[0][ts_at] < now - span:
                rows.popleft()
        while self.events and self.events[0]["ts"] < now - SPANS["events"]:
            self.events.popleft()
        tops = {self.run_index[r.name]: r.last_step for r in self.runs.values() if r.last_step is not None}
        while self.steps and self.steps[0][2] <= tops.get(self.steps[0][0], 0) - STEP_SPAN:
            self.steps.popleft()
        for run in self.runs.values():
            run.checkpoints = [c for c in run.checkpoints if c[0] >= now - SPANS["checkpoints"]][-64:]

    def window(self, now: float) -> Window:
        self._trim(now)
        nodes = sorted(self.nodes, key=self.nodes.__getitem__)
        hosts = {h: v for h, v in self.hosts.items() if v["ts"] >= now - SPANS["hosts"]}
        return Window(
            now=now, nodes=nodes,
            steps=Table.from_rows(STEP_NUM, STEP_OBJ, list(self.steps)),
            gpus=Table.from_rows(GPU_NUM, GPU_OBJ, list(self.gpus)),
            ports=Table.from_rows(PORT_NUM, PORT_OBJ, list(self.ports)),
            probes=Table.from_rows(PROBE_NUM, (), list(self.probes)),
            events=list(self.events), hosts=hosts, runs=list(self.runs.values()),
            last_heard=dict(self.last_heard), interconnect=self.interconnect, gpu_bus=dict(self.gpu_bus),
            span=dict(SPANS), beats=list(self.beats.values()), losses=self._losses(),
            places=dict(self.places), fabric=self.interconnect, post_interval=dict(self.post_interval))

    def _losses(self) -> dict[str, np.ndarray]:
        out = {}
        for run, by_step in self.losses.items():
            keep = sorted(by_step)[-LOSS_SPAN:]
            for s in [s for s in by_step if s < keep[0]]:
                del by_step[s]
            out[run] = np.array([(s, by_step[s][1], by_step[s][2]) for s in keep], dtype=float).reshape(-1, 3)
        return out
