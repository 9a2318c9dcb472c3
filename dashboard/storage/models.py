"""Rollups: per window (10 s, 1 min) and per series owner, min / mean / max / last of every numeric field of a raw
time series (the GPU samples held in frames, the host samples' rows), with the count of raw samples (``n``) and the
time of the last one (``last_ts``).

One table per (raw series, tier), so that each tier's retention is dropping whole day partitions on PostgreSQL.
Columns are ``<field>_<stat>``; the rolled-up numeric fields are listed here explicitly (a new wire field becomes a
rollup column by a line here and a migration, never silently).
"""

from __future__ import annotations

from typing import Any

from django.db import models

from dashboard.telemetry.models import Cluster, GpuFrame, HostSample, Node, Run

STATS = ("min", "mean", "max", "last")
TIERS = (10, 60)  # seconds; 60 is a multiple of 10, so a bucket of either tier never straddles the other's edge

GPU_FIELDS = (
    "util_gpu_pct", "util_mem_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w", "power_limit_w",
    "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz", "ecc_sbe_volatile", "ecc_dbe_volatile",
    "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_pages_sbe", "retired_pages_dbe", "remap_correctable",
    "remap_uncorrectable", "pcie_replay_total", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max",
    "nvlink_links_up", "nvlink_links_total", "nvlink_crc_errors_total", "nvlink_replay_errors_total",
    "nvlink_recovery_errors_total",
)
HOST_FIELDS = ("cpu_pct", "load1", "mem_used_bytes", "mem_total_bytes", "disk_read_bytes_per_s",
               "disk_write_bytes_per_s", "net_rx_bytes_per_s", "net_tx_bytes_per_s")


class StatField(models.FloatField):
    """A statistic of a window: single precision on PostgreSQL (4 bytes, 7 significant digits; the charts draw 4), which
    halves the rollups on disk. SQLite stores every REAL in 8 bytes, so it keeps double precision."""

    def db_type(self, connection: Any) -> str | None:
        return "real" if connection.vendor == "postgresql" else super().db_type(connection)


def _rollup(name: str, table: str, keys: dict[str, models.Field[Any, Any]], fields: tuple[str, ...]) -> type[models.Model]:
    """A concrete rollup model: (cluster, node, *keys, ts) identify a window, ts being the window's start."""
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "cluster": models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+"),
        "node": models.ForeignKey(Node, on_delete=models.CASCADE, related_name="+"),
        **keys,
        "ts": models.DateTimeField(),
        "n": models.IntegerField(),  # raw samples summarised: the weight when late samples are merged in
        "last_ts": models.DateTimeField(),  # the newest raw sample's time: which "last" wins when late ones are merged
    }
    for f in fields:
        for s in STATS:
            attrs[f"{f}_{s}"] = StatField(null=True)
    # The unique key is the upsert's conflict target and the node pages' index (node first, then time: a node's
    # range is one index range scan whatever the GPU). ts is in it because PostgreSQL partitions by it.
    unique = ["node", "ts", *keys]
    attrs["Meta"] = type("Meta", (), {
        "db_table": table,
        "constraints": [models.UniqueConstraint(fields=unique, name=f"{table}_window")],
        "indexes": [models.Index(fields=["ts"], name=f"{table}_ts")],  # SQLite's chunked retention
    })
    return type(name, (models.Model,), attrs)


def _gpu_keys() -> dict[str, models.Field[Any, Any]]:
    return {"gpu_index": models.PositiveSmallIntegerField()}


GpuRollup10s = _rollup("GpuRollup10s", "storage_gpu_10s", _gpu_keys(), GPU_FIELDS)
GpuRollup1m = _rollup("GpuRollup1m", "storage_gpu_1m", _gpu_keys(), GPU_FIELDS)
HostRollup10s = _rollup("HostRollup10s", "storage_host_10s", {}, HOST_FIELDS)
HostRollup1m = _rollup("HostRollup1m", "storage_host_1m", {}, HOST_FIELDS)

GPU_TIERS: dict[int, type[models.Model]] = {10: GpuRollup10s, 60: GpuRollup1m}
# raw model -> (the rollups' extra key columns, the rolled-up fields, tier seconds -> rollup model). GPU samples are
# rolled up from their frames (in numpy, dashboard.storage.rollup), host samples from their rows (in SQL).
ROLLUPS: dict[type[models.Model], tuple[tuple[str, ...], tuple[str, ...], dict[int, type[models.Model]]]] = {
    GpuFrame: (("gpu_index",), GPU_FIELDS, GPU_TIERS),
    HostSample: ((), HOST_FIELDS, {10: HostRollup10s, 60: HostRollup1m}),
}

class RollupState(models.Model):
    """One row: how far the rollup pass and the raw retention have got.

    ``received_through``: batches received before it (less a margin, see dashboard.storage.rollup) have been rolled
    up. ``rolled_through``: the pass's start; the pages read rollups before it and raw samples after it.
    ``raw_purged_through``: raw samples (GPU frames, host rows) older than it were purged, so a window before it can
    no longer be recomputed from raw; late samples for it are merged into the rollup instead."""

    received_through = models.DateTimeField(null=True)
    rolled_through = models.DateTimeField(null=True)
    raw_purged_through = models.DateTimeField(null=True)
    # The newest StepFrame id the step rollup had seen: rows above it (less a margin for ids that commit out of
    # order) are the ones whose steps it checks for late rows.
    step_seen_id = models.BigIntegerField(null=True)


# The step split a run's history draws (per step: sum, count, min and max over the ranks).
STEP_SPLIT = ("step_time_s", "data_wait_s", "compute_s", "comm_s")


def _step_rollup() -> type[models.Model]:
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "run": models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+"),
        "step": models.BigIntegerField(),
        "ts": models.DateTimeField(),  # the newest rank's end of the step
        "n": models.IntegerField(),  # rank rows of the step
        "tokens": models.FloatField(null=True),  # summed over ranks
        "loss": models.FloatField(null=True),  # mean over the ranks that sent one
        "grad_norm": models.FloatField(null=True),
    }
    for f in STEP_SPLIT:
        for s in ("sum", "n", "min", "max"):
            attrs[f"{f}_{s}"] = models.FloatField(null=True)
    attrs["Meta"] = type("Meta", (), {
        "db_table": "storage_step",
        "constraints": [models.UniqueConstraint(fields=["run", "step"], name="storage_step_run_step")],
        "indexes": [models.Index(fields=["ts"], name="storage_step_ts")],  # retention
    })
    return type("StepRollup", (models.Model,), attrs)


# One row per (run, step), aggregated over the run's ranks: what the run page draws of a run's whole history, read
# from a row per step instead of a row per rank and step (a 1,024-rank run at one step a second: 88 million raw rows
# a day). Settled steps only (dashboard.storage.steps); the live tail is read from raw.
StepRollup = _step_rollup()


class StepRollupState(models.Model):
    """How far a run's steps are rolled up: every step up to ``rolled_to`` has its StepRollup row (as of the
    pass that wrote it; a late rank row for it is rolled again by the next pass, see RollupState.step_seen_id)."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="+")
    rolled_to = models.BigIntegerField()
