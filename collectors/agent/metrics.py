"""An optional Prometheus ``/metrics`` endpoint with dcgm-exporter's names, so existing Grafana dashboards work.

The collector builds the metric families from the agent's last interval when scraped, so the agent pays nothing
between scrapes. GPU metrics carry dcgm-exporter's labels (``gpu``, ``UUID``, ``pci_bus_id``, ``device``,
``modelName``, ``Hostname``) and units (framebuffer in MiB). Names are exposed exactly as DCGM spells them, as
gauges: prometheus_client would append ``_total`` to a counter named ``..._TOTAL``. What DCGM has no field for goes
under ``clusterdx_*``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from collectors.gpu.readers import THROTTLE_REASONS

if TYPE_CHECKING:
    from collectors.agent.agent import Agent

log = logging.getLogger("clusterdx.agent")

MIB = 1024 * 1024

# (GpuSample field, DCGM name, help, scale). Units follow dcgm-exporter.
DCGM: tuple[tuple[str, str, str, float], ...] = (
    ("util_gpu_pct", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", 1),
    ("util_mem_pct", "DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", 1),
    ("mem_used_bytes", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", 1 / MIB),
    ("temp_c", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", 1),
    ("power_w", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", 1),
    ("power_limit_w", "DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", 1),
    ("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", 1),
    ("mem_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", 1),
    ("ecc_sbe_volatile", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", 1),
    ("ecc_dbe_volatile", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", 1),
    ("ecc_sbe_aggregate", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors.", 1),
    ("ecc_dbe_aggregate", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors.", 1),
    ("retired_pages_sbe", "DCGM_FI_DEV_RETIRED_SBE", "Total number of retired pages due to single-bit errors.", 1),
    ("retired_pages_dbe", "DCGM_FI_DEV_RETIRED_DBE", "Total number of retired pages due to double-bit errors.", 1),
    ("retired_pages_pending", "DCGM_FI_DEV_RETIRED_PENDING", "Number of pages pending retirement.", 1),
    ("remap_correctable", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable "
     "errors.", 1),
    ("remap_uncorrectable", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for "
     "uncorrectable errors.", 1),
    ("remap_pending", "DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether remapping of rows is pending.", 1),
    ("remap_failure", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed.", 1),
    ("pcie_replay_total", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", 1),
    ("pcie_gen", "DCGM_FI_DEV_PCIE_LINK_GEN", "PCIe link generation.", 1),
    ("pcie_width", "DCGM_FI_DEV_PCIE_LINK_WIDTH", "PCIe link width.", 1),
    ("pcie_gen_max", "DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "PCIe maximum link generation.", 1),
    ("pcie_width_max", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "PCIe maximum link width.", 1),
    ("nvlink_crc_errors_total", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "Total number of NVLink CRC "
     "errors (flit and data).", 1),
    ("nvlink_replay_errors_total", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "Total number of NVLink retries.",
     1),
    ("nvlink_recovery_errors_total", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "Total number of NVLink "
     "recovery errors.", 1),
)
# dcgm-exporter's label names, in its spelling.
LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")


class AgentCollector:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gpus = list(self.agent.last.gpus)
        labels = {g["index"]: self._labels(g) for g in gpus}
        for field, name, help_text, scale in DCGM:
            fam = GaugeMetricFamily(name, help_text, labels=LABELS)
            for g in gpus:
                if g.get(field) is not None:
                    fam.add_metric(labels[g["index"]], float(g[field]) * scale)
            yield fam
        yield from self._derived(gpus, labels, GaugeMetricFamily)
        yield from self._agent(CounterMetricFamily, GaugeMetricFamily)

    def _labels(self, g: dict[str, Any]) -> list[str]:
        return [str(g["index"]), g.get("uuid") or "", g.get("pci_bus_id") or "", f"nvidia{g['index']}",
                g.get("name") or "", self.agent.cfg.host]

    def _derived(self, gpus: list[dict[str, Any]], labels: dict[int, list[str]], gauge: Any) -> Iterator[Any]:
        fb_free = gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=LABELS)
        xid = gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=LABELS)
        mask = gauge("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons (bitmask).",
                     labels=LABELS)
        throttled = gauge("clusterdx_gpu_clock_event_reason", "1 while this clock event (throttle) reason holds.",
                          labels=(*LABELS, "reason"))
        links = gauge("clusterdx_gpu_nvlink_links_down", "NVLink links of this GPU that are not up.", labels=LABELS)
        bits = dict((name, bit) for bit, name in THROTTLE_REASONS)
        for g in gpus:
            lab = labels[g["index"]]
            if g.get("mem_total_bytes") is not None and g.get("mem_used_bytes") is not None:
                fb_free.add_metric(lab, (g["mem_total_bytes"] - g["mem_used_bytes"]) / MIB)
            xid.add_metric(lab, float(self.agent.last_xid.get(g["index"], 0)))
            if g.get("throttle_reasons") is not None:
                mask.add_metric(lab, float(sum(bits.get(r, 0) for r in g["throttle_reasons"])))
                for reason in bits:
                    throttled.add_metric([*lab, reason], 1.0 if reason in g["throttle_reasons"] else 0.0)
            if g.get("nvlink_links_total") is not None and g.get("nvlink_links_up") is not None:
                links.add_metric(lab, float(g["nvlink_links_total"] - g["nvlink_links_up"]))
        yield from (fb_free, xid, mask, throttled, links)

    def _agent(self, counter: Any, gauge: Any) -> Iterator[Any]:
        a = self.agent
        stats = a.sender.stats
        depth = gauge("clusterdx_agent_spool_batches", "Batches waiting in the on-disk spool.")
        depth.add_metric([], a.spool.depth)
        size = gauge("clusterdx_agent_spool_bytes", "Size of the batches waiting in the spool.")
        size.add_metric([], a.spool.size_bytes)
        sent = counter("clusterdx_agent_batches_sent", "Batches the server accepted (including duplicates).")
        sent.add_metric([], stats.sent)
        rejected = counter("clusterdx_agent_batches_rejected", "Batches the server refused with a 4xx (dropped).")
        rejected.add_metric([], stats.rejected)
        failures = counter("clusterdx_agent_delivery_failures", "Delivery attempts that will be retried.")
        failures.add_metric([], stats.failures)
        send = gauge("clusterdx_agent_send_interval_seconds",
                     "Minimum seconds between posts: the agent's setting or the server's advert, whichever is larger.")
        send.add_metric([], a.send_interval_s())
        drops = counter("clusterdx_agent_dropped", "Records dropped by the agent, by reason.", labels=("reason",))
        for reason, n in sorted(a.drops_total.items()):
            drops.add_metric([reason], n)
        hook = counter("clusterdx_agent_hook_records", "Records received from training hooks, by kind.",
                       labels=("kind",))
        for source in a.sources:
            for kind, n in getattr(source, "received", {}).items():
                hook.add_metric([kind], n)
        errors = counter("clusterdx_agent_source_errors", "Source collections that raised.", labels=("source",))
        for name, n in sorted(a.source_errors.items()):
            errors.add_metric([name], n)
        yield from (depth, size, sent, rejected, failures, send, drops, hook, errors)


def serve(agent: Agent, addr: str, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.process_collector import ProcessCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    ProcessCollector(namespace="clusterdx_agent", registry=reg)  # the agent's own CPU and memory
    start_http_server(port, addr=addr, registry=reg)
    log.info("Prometheus metrics on http://%s:%d/metrics", addr, port)
