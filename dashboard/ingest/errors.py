"""Every way an ingest request can be refused: one row per error code, documented in the OpenAPI document."""

from __future__ import annotations

# code -> (HTTP status, what it means). A 4xx never succeeds on retry; agents drop the batch and log the detail --
# except 409 seq_reused, where the content is fine and only its number is taken: agents renumber and send it again.
ERRORS: dict[str, tuple[int, str]] = {
    "malformed_json": (400, "the body is not valid JSON (or not UTF-8)"),
    "invalid_batch": (400, "the JSON does not match the wire format; detail names the field"),
    "bad_encoding": (400, "Content-Encoding says gzip but the body is not valid gzip"),
    "clock_skew": (400, "sent_at or a record's ts is more than CLUSTERDX_INGEST_MAX_FUTURE_S ahead of the server's "
                        "clock, or sent_at is older than the retention; detail names it (fix the node's time sync)"),
    "missing_token": (401, "no 'Authorization: Bearer <token>' header"),
    "unknown_token": (401, "the token is unknown or revoked"),
    "wrong_cluster": (403, "the token belongs to another cluster than the batch names"),
    "token_scope": (403, "the token's scope does not allow this batch: an agent token posts only as its own node(s), "
                         "a hook token only steps, beats, runs and the hooks' own events; detail says which"),
    "method_not_allowed": (405, "only POST is accepted"),
    "seq_reused": (409, "this (agent_id, seq) was already stored with other content (the producer's counter went "
                        "back): renumber the batch and send it again"),
    "too_large": (413, "the body, compressed or decompressed, is over the limit"),
    "unsupported_media_type": (415, "Content-Type must be application/json; Content-Encoding gzip or identity"),
    "busy": (429, "the server's write queue is full; the batch was not stored: send it again after Retry-After "
                  "seconds (the body's send_interval_s is the least interval between posts the server wants)"),
    "unavailable": (503, "the database is unavailable; retry later (the batch was not stored)"),
}

