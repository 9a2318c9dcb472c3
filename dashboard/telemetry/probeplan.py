"""Server-planned probe peers (pingmesh-style): which nodes each agent probes. Pure functions, no Django.

Each node probes its same-leaf neighbours (at most ``k_local``: the nearest on a ring of the leaf's sorted members,
alternating sides, so a pair inside a leaf is probed from both ends) plus ``k_remote`` nodes on other leaves. The
remote sample rotates with a time epoch: in epoch ``e`` a node of leaf ``a`` probes the leaves at offsets
``1 + (e·k_remote + j) mod (m-1)`` (j < k_remote) in the sorted leaf list, so every node sees every other leaf within
``ceil((m-1)/k_remote)`` epochs and every leaf pair is covered from both sides in that time. Within the target leaf
the node is picked by this node's rank plus the epoch, so the pairs of two leaves rotate too. The fan-out is at most
``k_local + k_remote`` per node whatever the cluster size: 2,048 nodes never mean 2,048² pairs.

A node's leaf is its switch, else its rack; nodes with neither share one anonymous leaf (no place known yet).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PLAN = "same-leaf k + rotating cross-leaf sample"
UNPLACED = ""


@dataclass(frozen=True, slots=True)
class Layout:
    """The cluster's nodes grouped by leaf, built once (O(n)); :meth:`peers` is then O(k) per node."""

    leaves: tuple[str, ...]  # sorted leaf names
    members: dict[str, tuple[str, ...]]  # leaf -> its sorted host names
    where: dict[str, tuple[int, int]]  # host -> (leaf index, rank inside the leaf)

    @classmethod
    def build(cls, nodes: Iterable[tuple[str, str, str]]) -> Layout:
        """From (hostname, switch, rack) rows."""
        groups: dict[str, list[str]] = {}
        for host, switch, rack in nodes:
            groups.setdefault(switch or rack or UNPLACED, []).append(host)
        leaves = tuple(sorted(groups))
        members = {leaf: tuple(sorted(set(groups[leaf]))) for leaf in leaves}
        where = {host: (i, rank) for i, leaf in enumerate(leaves) for rank, host in enumerate(members[leaf])}
        return cls(leaves, members, where)

    def leaf_of(self, host: str) -> str | None:
        at = self.where.get(host)
        return None if at is None else self.leaves[at[0]]

    def peers(self, host: str, epoch: int, k_local: int = 4, k_remote: int = 4) -> list[str]:
        """The hosts ``host`` probes in ``epoch`` (same-leaf first), without itself or duplicates; [] if unknown."""
        at = self.where.get(host)
        if at is None:
            return []
        leaf_i, rank = at
        own = self.members[self.leaves[leaf_i]]
        out: list[str] = []
        # Same leaf: +1, -1, +2, -2, ... around the ring, so neighbour relations are mutual.
        n = len(own)
        for step in range(1, n):
            if len(out) >= min(k_local, n - 1):
                break
            for sign in (1, -1):
                other = own[(rank + sign * step) % n]
                if other != host and other not in out and len(out) < k_local:
                    out.append(other)
        m = len(self.leaves)
        if m > 1:
            for j in range(min(k_remote, m - 1)):
                offset = 1 + (epoch * k_remote + j) % (m - 1)
                target = self.members[self.leaves[(leaf_i + offset) % m]]
                out.append(target[(rank + epoch) % len(target)])
        return out


def epoch_of(now: float, epoch_s: float) -> int:
    return int(now // epoch_s)


def epochs_to_cover(leaf_count: int, k_remote: int) -> int:
    """Epochs within which every leaf pair is probed from both sides."""
    return 0 if leaf_count < 2 else -(-(leaf_count - 1) // max(1, min(k_remote, leaf_count - 1)))
