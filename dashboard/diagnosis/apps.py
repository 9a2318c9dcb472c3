from typing import Any

from django.apps import AppConfig

_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_FINDING = {
    "type": "object",
    "required": ["id", "kind", "state", "severity", "subject", "subject_type", "title", "action", "confidence",
                 "opened_at", "updated_at", "evidence"],
    "properties": {
        "id": {"type": "integer"}, "kind": {"type": "string"}, "state": {"enum": ["open", "resolved"]},
        "severity": {"enum": ["info", "warning", "error", "critical"]},
        "subject_type": {"enum": ["cluster", "node", "gpu", "rank", "link", "switch", "run"]},
        "subject": {"type": "string", "description": "node-003, node-003/gpu4, <run>/rank5, node-001~node-002, <run>, "
                    "leaf-12 (a switch or rack), leaf-1~leaf-2 (the uplinks between them)"},
        "title": {"type": "string"}, "action": {"type": "string"}, "confidence": {"type": "number"},
        "headline": {"type": "string", "description": "the one line of evidence that matters"},
        "url": {"type": "string", "description": "the finding's page"},
        "subject_url": {"type": "string", "description": "the page of its node, GPU, link, rank or run"},
        "run": {"type": ["integer", "null"]}, "cluster": {"type": "string"},
        "node": {"type": ["string", "null"], "description": "the node it names (a rank's or GPU's node; a link's one end)"},
        "peer_node": {"type": ["string", "null"], "description": "a link's other end"},
        "gpu_index": {"type": ["integer", "null"]}, "rank": {"type": ["integer", "null"]},
        "opened_at": {"type": "number"}, "updated_at": {"type": "number"}, "resolved_at": {"type": ["number", "null"]},
        "evidence": {"type": "object", "description": "metrics, window [t0, t1] and series to plot"},
        "acked_by": {"type": ["string", "null"], "description": "who acknowledged it (no more alerts until it "
                     "resolves)"},
        "acked_at": {"type": ["number", "null"]},
        "silenced": {"type": ["object", "null"], "description": "the active silence holding its alerts back: id, "
                     "until, reason, by"},
    },
}
_CAUSE = {
    "type": "object", "required": ["summary", "kind", "subject", "confidence"],
    "properties": {"summary": {"type": "string"}, "kind": {"type": "string"}, "subject": {"type": "string"},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
}


class DiagnosisConfig(AppConfig):
    name = "dashboard.diagnosis"
    label = "diagnosis"
    verbose_name = "Findings: what is holding a run back, and why"

    def openapi_paths(self) -> dict[str, Any]:
        from dashboard.diagnosis.detectors import KINDS

        def q(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
            return {"name": name, "in": "query", "required": False, "schema": schema, "description": text}

        sev = {"type": "array", "items": {"enum": ["info", "warning", "error", "critical"]}}
        findings = {"get": {
            "operationId": "listFindings",
            "summary": "Findings of the clusters you are a member of, newest change first, in pages",
            "description": "Filters combine (AND); state, kind and severity may repeat (OR). Pages: offset and "
                           "limit; the X-Total-Count header says how many match and a Link header (rel=next) "
                           "points at the next page while there is one.",
            "security": [{"session": []}],
            "parameters": [q("cluster", {"type": "string"}, "cluster name or id"),
                           q("run", {"type": "integer"}, "run id: its findings and those of its nodes"),
                           q("state", {"type": "array", "items": {"enum": ["open", "resolved"]}}, ""),
                           q("kind", {"type": "array", "items": {"enum": list(KINDS)}}, ""),
                           q("severity", sev, ""),
                           q("node", {"type": "string"}, "host name: findings about the node, its GPUs and ranks, "
                             "and the links it is an end of"),
                           q("since", {"type": "number"}, "epoch seconds: still open, or changed at or after it"),
                           q("until", {"type": "number"}, "epoch seconds: opened at or before it"),
                           q("offset", {"type": "integer", "minimum": 0}, "default 0"),
                           q("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "default 100")],
            "responses": {
                "200": {"description": "The findings", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"findings": {"type": "array", "items": _FINDING}}}}},
                    "headers": {
                        "X-Total-Count": {"schema": {"type": "integer"}, "description": "findings that match"},
                        "Link": {"schema": {"type": "string"}, "description": '<next page URL>; rel="next"'}}},
                "400": {"description": "A bad filter value (the reason in detail)", **_ERROR},
                "401": {"description": "Not logged in", **_ERROR},
                "404": {"description": "No such cluster or run (or not yours)", **_ERROR},
            }}}
        path_params = [{"name": "run_id", "in": "path", "required": True, "schema": {"type": "integer"}},
                       {"name": "step", "in": "path", "required": True, "schema": {"type": "integer"}}]
        explain = {"get": {
            "operationId": "explainStep", "summary": "Why was this step slow? Each rank's split, every layer, the cause",
            "security": [{"session": []}], "parameters": path_params,
            "responses": {
                "200": {"description": "The step explained", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["run", "step", "window", "ranks", "layers", "cause"],
                    "properties": {
                        "run": {"type": "integer"}, "step": {"type": "integer"},
                        "window": {"type": "array", "items": {"type": "number"}},
                        "step_time_s": {"type": "number"}, "baseline_step_time_s": {"type": ["number", "null"]},
                        "ranks": {"type": "array", "items": {"type": "object", "description":
                                  "rank, host, gpu, data_wait_s, compute_s, comm_s, comm_arrive_s, GPU util/clocks"}},
                        "layers": {"type": "object", "description": "gpus, nccl, xid, ib, probes, other_events"},
                        "findings": {"type": "array", "items": _FINDING},
                        "cause": _CAUSE}}}}},
                "401": {"description": "Not logged in", **_ERROR},
                "404": {"description": "No such run or step (or not yours)", **_ERROR},
            }}}
        return {"/api/v1/findings": findings, "/api/v1/runs/{run_id}/steps/{step}/explain": explain}
