"""Hierarchical consolidation of per-rank write results into the coordinator's metadata.

Ranks hand their results to a leader per node, leaders to the coordinator, point to point on
the checkpoint's own (gloo) process group, inside ``write_data`` on DCP's background thread:
never on the training thread. DCP's own gather then carries an empty list from every rank but
the coordinator, which holds everything ``finish`` needs.

Nodes are the ranks sharing a host name (gathered once per group and cached);
``DCP_DATASTATES_RANKS_PER_NODE`` overrides that with consecutive blocks of ranks, for tests and
for clusters whose host names do not identify nodes.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist

__all__ = ["node_layout", "consolidate_results"]

_layouts: dict[Any, list[list[int]]] = {}


def node_layout(group, world: int) -> list[list[int]]:
    """Group ranks (ranks in ``group``) by node; the first rank of each node is its leader."""
    override = os.environ.get("DCP_DATASTATES_RANKS_PER_NODE")
    if override:
        per = max(1, int(override))
        return [list(range(s, min(s + per, world))) for s in range(0, world, per)]
    key = (id(group), world)
    if key not in _layouts:
        hosts: list[str | None] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        nodes: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            nodes.setdefault(str(h), []).append(r)
        _layouts[key] = sorted(nodes.values())
    return _layouts[key]


def consolidate_results(results: list, group, coordinator: int = 0) -> list:
    """Return all ranks' results on the coordinator and [] elsewhere, moving them rank -> node
    leader -> coordinator. ``group`` None means the default group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = node_layout(group, world)
    if len(layout) == 1:
        # One node: DCP's own gather is already the one hop to the coordinator.
        return results

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    node = next(n for n in layout if rank in n)
    leader = coordinator if coordinator in node else node[0]
    if rank != leader:
        dist.send_object_list([results], dst=glob(leader), group=group)
        return []
    combined = list(results)
    for member in node:
        if member != leader:
            box = [None]
            dist.recv_object_list(box, src=glob(member), group=group)
            combined.extend(box[0])
    if rank != coordinator:
        dist.send_object_list([combined], dst=glob(coordinator), group=group)
        return []
    for other in layout:
        if coordinator in other:
            continue
        box = [None]
        dist.recv_object_list(box, src=glob(other[0]), group=group)
        combined.extend(box[0])
    return combined
