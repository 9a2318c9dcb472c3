"""An owner's topology file applied to a cluster's nodes: the command line and the settings page both call
:func:`upload`, so both check, store and audit-log the same way.

The file is the owner's word for the whole cluster and wins over what agents report (``Node.placed_by = "file"``;
:meth:`dashboard.ingest.writer._Inventory.place_node` never overwrites such a node). A part the file leaves empty
keeps what was known. Hosts no agent has reported yet are kept as :class:`PendingPlacement` rows and placed when
their Node is created (:func:`place_new_node`, on ``post_save``), not created now: a node row without an agent
would look like a silent node on every page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from clusterdx.topology import FIELDS, Place, TopologyError, parse_file
from dashboard.telemetry import audit
from dashboard.telemetry.models import Cluster, Node, PendingPlacement

MAX_BYTES = 8 << 20  # a 100,000-line CSV is ~4 MB


@dataclass
class Applied:
    placed: int = 0  # nodes whose place changed
    unchanged: int = 0
    unknown: list[str] = field(default_factory=list)  # hosts in the file that no agent has reported yet

    def summary(self, cluster: Cluster) -> str:
        text = f"{cluster.name}: {_count(self.placed, 'node')} placed, {self.unchanged} unchanged"
        if self.unknown:
            shown = ", ".join(self.unknown[:5]) + (", ..." if len(self.unknown) > 5 else "")
            text += f"; {_count(len(self.unknown), 'host')} not seen yet, placed when their agents first report: {shown}"
        return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def read(data: bytes, name: str) -> dict[str, Place]:
    if len(data) > MAX_BYTES:
        raise TopologyError(f"{name}: {len(data)} bytes, at most {MAX_BYTES}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TopologyError(f"{name}: not UTF-8 text") from None
    return parse_file(text, name)


@transaction.atomic
def upload(cluster: Cluster, data: bytes, name: str, *, actor: Any) -> Applied:
    """Parse ``data`` (CSV, JSON or a Slurm topology.conf, see :mod:`clusterdx.topology`) and place the nodes."""
    places = read(data, name)
    done = Applied()
    changed = []
    nodes = {n.hostname: n for n in Node.objects.filter(cluster=cluster).only("id", "hostname", *FIELDS, "placed_by")}
    for host, place in places.items():
        node = nodes.get(host) or nodes.get(host.split(".")[0])
        if node is None:
            done.unknown.append(host)
            continue
        want = {k: place.get(k) or getattr(node, k) for k in FIELDS}
        if all(getattr(node, k) == v for k, v in want.items()) and node.placed_by == "file":
            done.unchanged += 1
            continue
        for k, v in want.items():
            setattr(node, k, v)
        node.placed_by = "file"
        changed.append(node)
    Node.objects.bulk_update(changed, [*FIELDS, "placed_by"], batch_size=500)
    done.placed = len(changed)
    done.unknown.sort()
    # The latest upload is the owner's word: what earlier ones said about hosts still not seen goes.
    PendingPlacement.objects.filter(cluster=cluster).delete()
    PendingPlacement.objects.bulk_create([PendingPlacement(cluster=cluster, hostname=h, **places[h])
                                          for h in done.unknown], batch_size=500)
    audit.record(actor, "topology.upload", cluster=cluster, target=name[:255], placed=done.placed,
                 unchanged=done.unchanged, unknown=len(done.unknown))
    return done


def place_new_node(sender: type[Node], instance: Node, created: bool, **kwargs: Any) -> None:
    """``post_save`` of a Node: a host an upload named before its agent first reported takes the file's place.
    One small read per node ever created; batches of known nodes never get here."""
    if not created or kwargs.get("raw"):
        return
    pending = PendingPlacement.objects.filter(cluster_id=instance.cluster_id,
                                              hostname__in={instance.hostname, instance.hostname.split(".")[0]}).first()
    if pending is None:
        return
    for k in FIELDS:
        setattr(instance, k, getattr(pending, k))
    instance.placed_by = "file"
    Node.objects.filter(id=instance.id).update(**{k: getattr(pending, k) for k in FIELDS}, placed_by="file")
    pending.delete()
