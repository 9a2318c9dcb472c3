"""The URL of every subject a page or an alert names: cluster, node, GPU, link, rank, run, finding.

One place, so an alert, an API row and a template all link a subject to the same page."""

from __future__ import annotations

from typing import Any

from django.urls import reverse


def cluster_url(cluster: str) -> str:
    return reverse("cluster", args=[cluster])


def node_url(cluster: str, host: str) -> str:
    return reverse("node", args=[cluster, host])


def gpu_url(cluster: str, host: str, index: int) -> str:
    return reverse("gpu", args=[cluster, host, index])


def link_url(cluster: str, a: str, b: str) -> str:
    """A link is unordered: node-001~node-002 and node-002~node-001 are one page."""
    a, b = sorted((a, b))
    return reverse("link", args=[cluster, a, b])


def run_url(run_id: int) -> str:
    return reverse("run", args=[run_id])


def rank_url(run_id: int, rank: int) -> str:
    return reverse("rank", args=[run_id, rank])


def finding_url(finding_id: int) -> str:
    return reverse("finding", args=[finding_id])


def findings_url(cluster: str) -> str:
    return reverse("findings", args=[cluster])


def subject_url(finding: Any) -> str:
    """The page of what a finding is about (its node, GPU, link, rank or run), falling back to the cluster."""
    cluster = finding.cluster.name
    host = finding.node.hostname if finding.node_id else None
    kind = finding.subject_type
    if kind == "gpu" and host and finding.gpu_index is not None:
        return gpu_url(cluster, host, finding.gpu_index)
    if kind == "link" and host and finding.peer_node_id:
        return link_url(cluster, host, finding.peer_node.hostname)
    if kind == "rank" and finding.run_id and finding.rank is not None:
        return rank_url(finding.run_id, finding.rank)
    if kind == "run" and finding.run_id:
        return run_url(finding.run_id)
    if host:
        return node_url(cluster, host)
    return cluster_url(cluster)
