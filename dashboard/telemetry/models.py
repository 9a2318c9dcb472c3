"""Inventory (cluster, node, GPU, run, rank) and the time series the agents and hooks send.

Time series carry a denormalised ``cluster`` and are indexed by (owner, ts) so that every time-range query a page, the
diagnosis or the retention task runs is an index range scan: per cluster, per node, per run.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models


class Cluster(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Who may see the cluster, and with which role (Membership.role); ``members.add(user)`` makes a plain member.
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="clusters", through="Membership")
    # The interconnect an owner set, overriding the one detected from the agents' ports ("auto": use the detected
    # one); the NCCL checks read the effective value (dashboard.telemetry.interconnect.effective).
    interconnect = models.CharField(max_length=16, default="auto", choices=[
        ("auto", "Detected"), ("ib", "InfiniBand"), ("roce", "RoCE"), ("eth", "Ethernet")])

    def __str__(self) -> str:
        return self.name

    def visible_to(self, user: object) -> bool:
        return bool(getattr(user, "is_superuser", False)) or self.members.filter(pk=getattr(user, "pk", None)).exists()

    def nccl_interconnect(self) -> str:
        """"ib" or "eth" for the NCCL checks: the override, else what the agents' ports show (telemetry.interconnect)."""
        from dashboard.telemetry import interconnect

        return interconnect.for_nccl(self)

    def interconnect_label(self) -> str:
        """What the pages show: "InfiniBand (detected)", "Ethernet (set by an owner)"."""
        from dashboard.telemetry import interconnect

        if self.interconnect in interconnect.KINDS:
            how = "set by an owner"
        else:
            how = "detected" if interconnect.detected(self).kind else "assumed: no agent has reported yet"
        return f"{interconnect.LABELS[interconnect.effective(self)]} ({how})"


class Role(models.TextChoices):
    """What a member may do, each role including the ones below it (dashboard.web.access.has_role)."""

    VIEWER = "viewer"  # reads every page and API of the cluster
    MEMBER = "member"  # and acknowledges / silences findings
    OWNER = "owner"  # and changes settings, members, tokens and webhooks


ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.OWNER: 2}


class Membership(models.Model):
    """A user's role in a cluster. The table is the one Django made for the plain ``members`` many-to-many before
    roles existed (migration 0006 adds ``role`` to it), so every earlier membership carries over as "member"."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        db_table = "telemetry_cluster_members"
        unique_together = [("cluster", "user")]

    def __str__(self) -> str:
        return f"{self.user} {self.role} of {self.cluster}"


class AuditEntry(models.Model):
    """Who changed what: members, roles, tokens, webhooks, silences, cluster settings (dashboard.telemetry.audit).

    The actor's name is copied so that an entry outlives the account; ``cluster`` is null for server-wide changes
    (a user added)."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, null=True, blank=True, related_name="audit")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                              related_name="+")
    actor_name = models.CharField(max_length=150)  # a user name, or "cli:<os user>" for the command line
    action = models.CharField(max_length=48)  # e.g. "member.add", "token.revoke", "silence.create"
    target = models.CharField(max_length=255, blank=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [models.Index(fields=["cluster", "-at"])]


class IngestToken(models.Model):
    """A bearer token for agents and hooks of one cluster. Only a SHA-256 digest is stored; the secret is shown once."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=64, blank=True)
    prefix = models.CharField(max_length=16, unique=True)  # public part, used to find the row
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # What the token may post (dashboard.telemetry.tokens.scope_refusal): "cluster" anything as any node (legacy,
    # the only kind before 0005), "agent" anything but only as the nodes ``hosts`` names, "hook" only what training
    # processes send. A stolen node or job token then cannot forge another node's Xid.
    scope = models.CharField(max_length=8, default="cluster",
                             choices=[("cluster", "cluster"), ("agent", "agent"), ("hook", "hook")])
    hosts = models.CharField(max_length=1024, blank=True, default="")  # agent: host names or patterns, space-separated


class Node(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    hostname = models.CharField(max_length=253)
    agent_id = models.CharField(max_length=128, blank=True)
    first_seen = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(null=True)
    # Where the node sits in the fabric, when known (agent config, Slurm topology.conf, Kubernetes labels): pages
    # group nodes by it, and "everything behind leaf switch 12" becomes something a page and a finding can say.
    rack = models.CharField(max_length=64, blank=True, default="")
    switch = models.CharField(max_length=64, blank=True, default="")
    spine = models.CharField(max_length=64, blank=True, default="")
    # Who set the place: "agent" (its config, environment or node labels) or "file" (an owner's upload of the whole
    # cluster's topology). An uploaded place wins: the writer never lets an agent's report overwrite it.
    placed_by = models.CharField(max_length=8, blank=True, default="")
    # The newest interface list its agent sent (wire.NetInterface records) and its sample time: kept here by the
    # ingest writer when it changes, so the diagnosis pass and the node page read one row per node instead of
    # searching the 1 Hz host samples for the rare one that carries a list.
    interfaces = models.JSONField(null=True)
    interfaces_at = models.DateTimeField(null=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "hostname"], name="node_unique_host")]

    def __str__(self) -> str:
        return self.hostname


class PendingPlacement(models.Model):
    """A host's place from an uploaded topology file, kept until its agent first reports and its Node is created
    (dashboard.telemetry.placement): an owner may upload the fabric before the agents are deployed."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="pending_placements")
    hostname = models.CharField(max_length=253)
    rack = models.CharField(max_length=64, blank=True, default="")
    switch = models.CharField(max_length=64, blank=True, default="")
    spine = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "hostname"], name="pending_placement_unique_host")]


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96, blank=True)
    name = models.CharField(max_length=96, blank=True)
    pci_bus_id = models.CharField(max_length=32, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index")]


class Run(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=128)
    created_at = models.DateTimeField(auto_now_add=True)
    last_step = models.BigIntegerField(null=True)
    last_step_at = models.DateTimeField(null=True)
    world_size = models.PositiveIntegerField(null=True)
    # Run-wide facts from RunMeta (versions, parallel sizes, FLOPs per token, peak FLOPS...).
    meta = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "name"], name="run_unique_name")]

    def __str__(self) -> str:
        return self.name


class Rank(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="ranks")
    rank = models.PositiveIntegerField()
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, related_name="ranks")
    local_rank = models.PositiveIntegerField(null=True)
    gpu_index = models.PositiveSmallIntegerField(null=True)
    meta = models.JSONField(default=dict)  # this rank's RunMeta (env, dataloader, versions)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "rank"], name="rank_unique")]


class AgentBatch(models.Model):
    """One accepted batch: the idempotency record for (cluster, agent_id, seq)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE)
    agent_id = models.CharField(max_length=128)
    seq = models.BigIntegerField()
    host = models.CharField(max_length=253)
    received_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True)  # the producer's clock: received - sent shows transit delay or skew
    records = models.PositiveIntegerField(default=0)
    dropped = models.JSONField(null=True)
    # SHA-256 of the content (dashboard.ingest.writer.digest): a repeat of this seq with another digest is a reused
    # seq (409), not a duplicate. Empty on rows stored before digests existed.
    digest = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "agent_id", "seq"], name="batch_unique_seq")]
        indexes = [models.Index(fields=["cluster", "received_at"])]


# The time-series tables below take a few rows per node every second. Their references to the inventory are not
# enforced by the database (db_constraint=False): on PostgreSQL a foreign key is a trigger and a lookup per row at
# commit, which was half of its CPU for an ingested batch (40,000 GPU rows: 29 -> 14 µs a row, and 11 µs without the
# single-column indexes that only repeat a composite index's first column, db_index=False below). The ingest writer
# takes ids only from inventory rows it read or created, the app never deletes a node or run, and deleting a cluster
# through Django still cascades (Django does it, not the constraint).
def _series_ref(to: type[models.Model] | str, on_delete: Any = models.CASCADE, index: bool = False,
                **kwargs: Any) -> models.ForeignKey:
    return models.ForeignKey(to, on_delete=on_delete, db_constraint=False, db_index=index, **kwargs)


class HostSample(models.Model):
    cluster = _series_ref(Cluster)  # (cluster, ts) and (node, ts) are indexed
    node = _series_ref(Node)
    ts = models.DateTimeField()
    cpu_pct = models.FloatField(null=True)
    load1 = models.FloatField(null=True)
    mem_used_bytes = models.BigIntegerField(null=True)
    mem_total_bytes = models.BigIntegerField(null=True)
    disk_read_bytes_per_s = models.FloatField(null=True)
    disk_write_bytes_per_s = models.FloatField(null=True)
    net_rx_bytes_per_s = models.FloatField(null=True)
    net_tx_bytes_per_s = models.FloatField(null=True)
    nfs = models.JSONField(null=True)
    # wire.NetInterface records, as sent: null on most rows (agents send them when they change and every few
    # minutes). The history ("when did eth1 go down"); the newest list is kept on the Node.
    interfaces = models.JSONField(null=True)

    class Meta:
        indexes = [models.Index(fields=["cluster", "ts"]), models.Index(fields=["node", "ts"])]


class PortSample(models.Model):
    cluster = _series_ref(Cluster)  # (cluster, ts) and (node, ts) are indexed
    node = _series_ref(Node)
    ts = models.DateTimeField()
    device = models.CharField(max_length=64)
    port = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=32, null=True)
    phys_state = models.CharField(max_length=32, null=True)
    rate_gbps = models.FloatField(null=True)
    link_layer = models.CharField(max_length=32, null=True)
    interval_s = models.FloatField(null=True)
    xmit_bytes_per_s = models.FloatField(null=True)
    rcv_bytes_per_s = models.FloatField(null=True)
    counters = models.JSONField(null=True)
    unavailable = models.JSONField(null=True)

    class Meta:
        indexes = [models.Index(fields=["cluster", "ts"]), models.Index(fields=["node", "ts"])]


RANK_GROUP = 8  # ranks per step frame (its rank_group: rank // 8): a node's ranks, on the usual 8-GPU node


class Event(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, null=True)
    run = models.ForeignKey(Run, on_delete=models.SET_NULL, null=True)
    ts = models.DateTimeField()
    kind = models.CharField(max_length=16)
    severity = models.CharField(max_length=16)
    code = models.IntegerField(null=True)
    gpu_index = models.PositiveSmallIntegerField(null=True)
    pci_bus_id = models.CharField(max_length=32, null=True)
    rank = models.PositiveIntegerField(null=True)
    step = models.BigIntegerField(null=True)
    message = models.TextField(blank=True)
    data = models.JSONField(null=True)

    class Meta:
        indexes = [
            models.Index(fields=["cluster", "ts"]),
            models.Index(fields=["node", "ts"]),
            models.Index(fields=["run", "ts"]),
            models.Index(fields=["cluster", "kind", "ts"]),
        ]


class GpuFrame(models.Model):
    """A node's GPU samples from one post within one aligned 10 s window, as one packed matrix
    (:mod:`dashboard.storage.frames`): ``ts`` is the oldest sample's time, ``n`` the samples, ``data`` the matrix and
    the object fields (throttle reasons, why a field is unavailable) LZ4-compressed in ``layout``'s column order."""

    cluster = _series_ref(Cluster)  # (cluster, ts) and (node, ts) are indexed
    node = _series_ref(Node)
    ts = models.DateTimeField()
    n = models.PositiveIntegerField()
    layout = models.PositiveSmallIntegerField(default=0)
    data = models.BinaryField()

    class Meta:
        indexes = [models.Index(fields=["cluster", "ts"]), models.Index(fields=["node", "ts"])]


class StepFrame(models.Model):
    """Training steps from one post: one run, one aligned group of RANK_GROUP ranks, one aligned bucket of steps
    (dashboard.storage.frames.STEP_BUCKET) and one aligned 10 s window, as one packed matrix. ``step_lo`` and
    ``step_hi`` bound its steps: a run's steps ``a..b`` are in the frames with ``step_hi`` in [bucket start of a,
    bucket end of b], a rank's in those of its ``rank_group`` too."""

    cluster = _series_ref(Cluster)
    run = _series_ref(Run)
    # Not indexed, and nothing done on a node's deletion: nothing reads steps by node, and nodes are deleted only with
    # their cluster, whose frames Django deletes by cluster (SET_NULL would scan the table for every node deleted).
    node = _series_ref(Node, models.DO_NOTHING, null=True)
    ts = models.DateTimeField()
    rank_group = models.PositiveIntegerField()
    step_lo = models.BigIntegerField()
    step_hi = models.BigIntegerField()
    n = models.PositiveIntegerField()
    layout = models.PositiveSmallIntegerField(default=0)
    data = models.BinaryField()

    class Meta:
        indexes = [
            models.Index(fields=["run", "step_hi"]),
            models.Index(fields=["run", "rank_group", "step_hi"]),
            models.Index(fields=["run", "ts"]),
            models.Index(fields=["cluster", "ts"]),
        ]


class ProbeFrame(models.Model):
    """The probes one post carried from ``node`` within one aligned 10 s window, as one packed matrix. ``peers`` lists
    their distinct peers between spaces (" a b "): the frames holding probes *to* a host are those whose ``peers``
    contains " host " within the time range (a row per probe and an index by peer cost more than anything else the
    ingest writer did: docs/scaling.md)."""

    cluster = _series_ref(Cluster)  # (cluster, ts) and (node, ts) are indexed
    node = _series_ref(Node, related_name="probe_frames")
    ts = models.DateTimeField()
    n = models.PositiveIntegerField()
    layout = models.PositiveSmallIntegerField(default=0)
    data = models.BinaryField()
    peers = models.TextField()

    class Meta:
        indexes = [models.Index(fields=["cluster", "ts"]), models.Index(fields=["node", "ts"])]


class ProbeInbound(models.Model):
    """Which probe frames hold probes *to* ``peer`` within one minute (``ts``, its start). A probe frame is kept by
    its sender; the probes a host was sent (its node page, a node-down finding's evidence) are found through this
    index rather than by searching the cluster's every frame of the range for the host's name. Built from the
    frames' ``peers`` a few seconds behind ingest (:mod:`dashboard.storage.probe_index`), so ingest writes nothing
    per probe."""

    cluster = _series_ref(Cluster)
    peer = models.CharField(max_length=253)
    ts = models.DateTimeField()
    n = models.PositiveIntegerField()  # frames listed
    frames = models.BinaryField()  # their ids, ascending: LZ4-packed little-endian int64 differences

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "peer", "ts"], name="probe_inbound_minute")]
        indexes = [models.Index(fields=["ts"], name="probe_inbound_ts")]  # retention on SQLite


class ProbeIndexState(models.Model):
    """One row: every ProbeFrame with an id up to ``seen_id`` is in the ProbeInbound index (but for frames of a
    PostgreSQL transaction that committed later than ids above it: each pass reads a margin below again)."""

    seen_id = models.BigIntegerField(default=0)
