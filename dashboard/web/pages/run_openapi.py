"""OpenAPI path items of the run and rank pages' API (gathered into /api/openapi.json)."""

from __future__ import annotations

from typing import Any

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {"401": {"description": "Not logged in", **_ERROR},
           "404": {"description": "No such run or rank (or not yours)", **_ERROR}}
_RUN = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "integer"}}
_RANK = {"name": "rank", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}


def _q(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": text}


_STEPS = [_q("from_step", {"type": "integer", "minimum": 0}, "first step (default: the run's first)"),
          _q("to_step", {"type": "integer", "minimum": 0}, "last step (default: the run's last)")]
_BAND = {"type": "object", "properties": {s: {"type": "array", "items": {"type": ["number", "null"]}}
                                          for s in ("min", "mean", "max")}}
_NUMS = {"type": "array", "items": {"type": ["number", "null"]}}


def _ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _get(op: str, summary: str, params: list[dict[str, Any]], ok: dict[str, Any],
         bad: bool = False) -> dict[str, Any]:
    responses = {"200": ok, **_ERRORS}
    if bad:
        responses["400"] = {"description": "A bad parameter", **_ERROR}
    return {"get": {"operationId": op, "summary": summary, "security": [{"session": []}], "parameters": params,
                    "responses": responses}}


OPENAPI: dict[str, Any] = {
    "/api/v1/runs/{run_id}/steps": _get(
        "getRunSteps", "The whole run (or a window of steps) in at most ?points= buckets of steps: the split, "
        "tokens/s, loss, grad norm, MFU and goodput",
        [_RUN, *_STEPS, _q("points", {"type": "integer", "minimum": 10, "maximum": 3000}, "buckets (default 600)"),
         _q("rank", {"type": "integer", "minimum": 0}, "one rank's steps only")],
        _ok("Buckets of ceil((to_step - from_step + 1) / points) steps; min / mean / max over every rank-step in a "
            "bucket", {"type": "object", "required": ["run", "first_step", "last_step", "bucket_steps", "step"],
                       "properties": {
                           "first_step": {"type": ["integer", "null"]}, "last_step": {"type": ["integer", "null"]},
                           "from_step": {"type": "integer"}, "to_step": {"type": "integer"},
                           "bucket_steps": {"type": "integer"},
                           "step": {"type": "array", "items": {"type": "integer"}, "description": "bucket's first"},
                           "step_end": {"type": "array", "items": {"type": "integer"}},
                           "slowest_step": {"type": "array", "items": {"type": "integer"},
                                            "description": "the bucket's step with the longest mean step time"},
                           "ts": _NUMS, "ranks": {"type": "array", "items": {"type": "integer"}},
                           "step_time_s": _BAND, "data_wait_s": _BAND, "compute_s": _BAND, "comm_s": _BAND,
                           "tokens_per_s": _BAND, "loss": _NUMS, "grad_norm": _NUMS,
                           "mfu": {**_NUMS, "description": "model FLOPs utilisation over each bucket's last 16 "
                                   "steps, as the diagnosis computes it (needs flops_per_token and peak_flops)"},
                           "goodput": _NUMS,
                           "efficiency": {"type": ["object", "null"], "description": "tokens_per_s, mfu, goodput, "
                                          "median_step_s over the run's last 16 steps"},
                           "mfu_step": {**_NUMS, "description": "mean over the bucket of each step's MFU as the "
                                        "diagnosis stored it (StepEfficiency)"},
                           "run_efficiency": {"type": ["object", "null"], "description": "the whole run, as stored "
                                              "by the diagnosis: goodput, mfu, tokens_per_s, wall_s, productive_s, "
                                              "lost_s {stall, checkpoint, restart, replayed}, restarts, through_step "
                                              "(docs/diagnosis.md, MFU and goodput)"},
                           "loss_spikes": {"type": "array", "items": {
                               "type": "object", "description": "step, loss, severity, title, url: a loss_spike "
                               "finding in the range"}}}}), bad=True),
    "/api/v1/runs/{run_id}/heatmap": _get(
        "getRunHeatmap", "Rank x step heatmap of one metric: ranks ordered by node then local rank (a straggler is "
        "a stripe, a sick node a band), steps in at most 600 columns",
        [_RUN, _q("metric", {"enum": ["compute_s", "data_wait_s", "comm_arrive_s", "step_time_s"]},
                  "default compute_s"), *_STEPS,
         _q("points", {"type": "integer", "minimum": 10, "maximum": 600}, "columns (default 600)")],
        _ok("z[row][column] is the mean of the metric over the column's steps (null: no row)", {
            "type": "object", "required": ["metric", "steps", "rows", "nodes", "z"], "properties": {
                "metric": {"type": "string"}, "bucket_steps": {"type": "integer"},
                "steps": {"type": "array", "items": {"type": "integer"}, "description": "each column's first step"},
                "row_kind": {"enum": ["rank", "node"], "description": "node above 2,048 ranks (max over its ranks)"},
                "rows": {"type": "array", "items": {"type": "object", "description": "label, rank, host, url"}},
                "nodes": {"type": "array", "items": {"type": "object", "description":
                          "host, url, first_row, rows: the node boundaries"}},
                "z": {"type": "array", "items": _NUMS},
                "scale": {"type": "object", "description": "p5, median, p99 of z"}}}), bad=True),
    "/api/v1/runs/{run_id}/settings": _get(
        "getRunSettings", "The run's settings as its ranks reported them, with what differs from the majority",
        [_RUN], _ok("world size, dtype, FLOPs per token, parallel layout; NCCL env with drift (the nccl_config "
                    "detector's rule); DataLoader config and versions with deviating ranks", {
                        "type": "object", "required": ["run", "env", "dataloader", "versions"], "properties": {
                            "world_size": {"type": ["integer", "null"]}, "ranks_reporting": {"type": "integer"},
                            "run_wide": {"type": "object"}, "parallel": {"type": "object"},
                            "env": {"type": "object", "description": "values: var -> {value, ranks, distinct, drift};"
                                    " drift: [{rank, url, host, node_url, gpu, gpu_url, key, value, majority}]"},
                            "dataloader": {"type": "object", "description": "values, deviations"},
                            "layout": {"type": "object", "description": "the parallel layout (RunMeta.layout: "
                                       "strategy, mesh, zero_stage, offload, activation_checkpointing, grad_accum, "
                                       "micro_batch...): values, deviations (mesh coordinates are not drift)"},
                            "versions": {"type": "object", "description": "values, deviations"}}})),
    "/api/v1/runs/{run_id}/nccl": _get(
        "getRunNccl", "NCCL per rank (the transport class each rank set up since the run began, in node order, "
        "with the ranks on sockets), per node (transports, network, GDR from its NCCL logs; env flags) and warnings",
        [_RUN], _ok("Suspect nodes first", {"type": "object", "required": ["ranks", "nodes", "warnings"], "properties": {
            "interconnect": {"type": "string", "enum": ["ib", "roce", "eth"]},
            "socket_expected": {"type": "boolean", "description": "the interconnect is IB or RoCE: sockets are a fault"},
            "ranks": {"type": "object", "required": ["classes", "order", "cls", "combo", "combos", "nodes", "socket",
                                   "rank_url_prefix"],
                      "description": "classes: [{key (socket, ib, net, ib_gdr, intra, unknown: worst first), label, "
                      "ranks, suspect}]; transports: name -> ranks using it; order: the ranks by node then local "
                      "rank; cls: per rank in order, its index into classes; combo: per rank, its index into "
                      "combos (its transports as text); nodes: [{host, url, first, count}] (runs of order); "
                      "socket: [{rank, url, host, node_url, gpu, gpu_url, transports}] (at most 200); socket_count; "
                      "rank_url_prefix: rank N's page is this + N + '/'",
                      "properties": {"order": {"type": "array", "items": {"type": "integer"}},
                                     "cls": {"type": "array", "items": {"type": "integer"}},
                                     "combo": {"type": "array", "items": {"type": "integer"}},
                                     "combos": {"type": "array", "items": {"type": "string"}},
                                     "classes": {"type": "array", "items": {"type": "object"}},
                                     "transports": {"type": "object"},
                                     "nodes": {"type": "array", "items": {"type": "object"}},
                                     "socket": {"type": "array", "items": {"type": "object"}},
                                     "socket_count": {"type": "integer"},
                                     "rank_url_prefix": {"type": "string"}}},
            "nodes": {"type": "array", "items": {"type": "object", "description":
                      "host, url, ranks, transports, networks, gdr, env, facts, warnings, suspect"}},
            "warnings": {"type": "array", "items": {"type": "object", "description":
                         "ts, host, node_url, rank, rank_url, severity, message"}}}})),
    "/api/v1/runs/{run_id}/ranks/{rank}": _get(
        "getRunRank", "One rank: its node and GPU (linked), settings, latest beat and findings", [_RUN, _RANK],
        _ok("The rank", {"type": "object", "required": ["run", "rank", "url", "meta", "findings"], "properties": {
            "host": {"type": ["string", "null"]}, "node_url": {"type": ["string", "null"]},
            "gpu": {"type": ["integer", "null"]}, "gpu_url": {"type": ["string", "null"]},
            "meta": {"type": "object", "description": "this rank's RunMeta"},
            "beat": {"type": ["object", "null"], "description": "state (idle, data, step, finished, crashed), "
                     "state_s, step, ts, received"},
            "bounds": {"type": ["array", "null"], "items": {"type": "integer"}},
            "findings": {"type": "array", "items": {"type": "object"}}}})),
}
