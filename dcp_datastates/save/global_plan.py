"""The coordinator's first-save global plan at scale: DCP's dedup and validation, per item in C.

DCP's ``DefaultSavePlanner`` makes a first save's global plan with per-item Python: a set per
write item for its dedup, and a sweep per tensor for its validation that sweeps the tensor's
largest dimension, so a weight sharded along a shorter one (FSDP's dim 0 of a wide matrix) tests
every pair of its chunks. At 1,024 ranks that is minutes and gigabytes on rank 0. The two steps
here give DCP's answers at a cost per item of a few C-level operations:

- ``dedup_plans``: DCP's dedup, the same plans out; found from one 64-bit hash per item, and
  only the items whose hash repeats are looked at in Python.
- ``suspect_tensors``: the tensors whose chunks may not tile them (the engine's
  ``find_bad_tilings``); the caller runs DCP's own validation on those alone, for its wording.

Its cost still grows with every rank's chunks, and the other ranks wait for it in DCP's scatter:
``warn_if_planning_is_slow`` says when it comes near the checkpoint group's timeout.
"""

from __future__ import annotations

import dataclasses
import logging
from array import array
from itertools import chain
from operator import attrgetter

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..native import engine_module

__all__ = ["dedup_plans", "suspect_tensors", "warn_if_planning_is_slow"]

log = logging.getLogger("dcp_datastates")
_engine = engine_module()
# Past this share of ``stall_timeout``, the coordinator's planning is logged as a warning.
SLOW_PLANNING_SHARE = 0.5
# What a MetadataIndex compares by.
_index_key = attrgetter("index.fqn", "index.offset")
_offsets = attrgetter("offsets")
_sizes = attrgetter("sizes")


def dedup_plans(all_plans: list, to_lowest_rank: bool) -> list:
    """DCP's ``dedup_save_plans``, with its result: each write item (name and offsets) that is in
    several plans stays in one. Without ``to_lowest_rank`` that is the candidate with the fewest
    bytes planned when the item is first met, meeting items plan by plan (DCP's rule, ties as
    DCP breaks them); only the plans where a duplicated item is first met are walked item by
    item. A plan that loses nothing is returned as it is."""
    hashes = [array("q", map(hash, map(_index_key, plan.items))) for plan in all_plans]
    columns = [torch.frombuffer(h, dtype=torch.int64) if len(h) else torch.empty(0, dtype=torch.int64) for h in hashes]
    ordered = torch.cat(columns).sort().values if columns else torch.empty(0, dtype=torch.int64)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]].unique()
    if not len(repeated):
        return list(all_plans)
    # The items whose hash repeats (a collision only costs a look), grouped by their key.
    suspects = [torch.isin(col, repeated).nonzero().flatten().tolist() for col in columns]
    # key -> [first plan, first position, plans holding it, its last item]
    groups: dict = {}
    # Per plan, the key at each of its suspect positions (the items are read once).
    keys = []
    for p, (plan, positions) in enumerate(zip(all_plans, suspects)):
        items = plan.items
        keys.append([_index_key(items[j]) for j in positions])
        for j, key in zip(positions, keys[-1]):
            group = groups.get(key)
            if group is None:
                groups[key] = [p, j, {p}, items[j]]
            else:
                group[2].add(p)
                group[3] = items[j]
    selected = _select_plans(all_plans, suspects, groups, to_lowest_rank)
    out = []
    for p, (plan, positions, plan_keys) in enumerate(zip(all_plans, suspects, keys)):
        items = plan.items
        lost = [j for j, key in zip(positions, plan_keys) if selected.get(key, p) != p]
        if not lost:
            out.append(plan)
            continue
        kept, previous = [], 0
        for j in lost:
            kept.extend(items[previous:j])
            previous = j + 1
        kept.extend(items[previous:])
        out.append(dataclasses.replace(plan, items=kept))
    return out


def _select_plans(all_plans: list, suspects: list, groups: dict, to_lowest_rank: bool) -> dict:
    """key -> the plan that keeps it, for every key in several plans. DCP decides in the order
    items are first met and counts each plan's bytes as it assigns them: a plan's own items count
    from when it is walked, so at a decision the first holder has the bytes of its items before
    the item, and every later holder only the duplicated items given to it earlier."""
    shared = {key: g for key, g in groups.items() if len(g[2]) > 1}
    if to_lowest_rank:
        return {key: g[0] for key, g in shared.items()}
    # First holder -> the position of the last shared item it meets first.
    last: dict[int, int] = {}
    for g in shared.values():
        last[g[0]] = max(last.get(g[0], -1), g[1])
    planned = [0] * len(all_plans)
    selected: dict = {}
    for p in sorted(last):
        items, suspect = all_plans[p].items, set(suspects[p])
        for j in range(last[p] + 1):
            item = items[j]
            if j not in suspect:
                planned[p] += item.tensor_storage_size() or 1
                continue
            key = _index_key(item)
            group = groups[key]
            if group[0] != p or group[1] != j:
                # Met before: decided already.
                continue
            chosen = p
            if len(group[2]) > 1:
                chosen = selected[key] = min(group[2], key=planned.__getitem__)
            planned[chosen] += group[3].tensor_storage_size() or 1
    return selected


def suspect_tensors(metadata: Metadata, several_plans: bool) -> list[str]:
    """The names of the tensors whose chunks may break what DCP's validation asks (inside the
    tensor, no shared element, and with ``several_plans`` the tensor's elements covered): a
    superset of those DCP's validation fails, exact unless a count reaches 2**62; in the
    metadata's order."""
    names: list[str] = []
    counts, ndims, dims = array("q"), array("q"), array("q")
    offsets, sizes = array("q"), array("q")
    suspects: list[str] = []
    for fqn, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            # DCP's validation skips these too.
            continue
        chunks, ndim = value.chunks, len(value.size)
        start, dims_start = len(offsets), len(dims)
        try:
            offsets.extend(chain.from_iterable(map(_offsets, chunks)))
            sizes.extend(chain.from_iterable(map(_sizes, chunks)))
            dims.extend(value.size)
        except (OverflowError, TypeError):
            ok = False
        else:
            ok = len(offsets) - start == len(chunks) * ndim == len(sizes) - start
        if not ok:
            # A chunk of another rank or beyond int64: DCP's own check decides.
            suspects.append(fqn)
            del offsets[start:], sizes[start:], dims[dims_start:]
            continue
        names.append(fqn)
        counts.append(len(chunks))
        ndims.append(ndim)
    suspects.extend(names[k] for k in _engine.find_bad_tilings(counts, ndims, dims, offsets, sizes, several_plans))
    if len(suspects) > 1:
        chosen = set(suspects)
        suspects = [fqn for fqn in metadata.state_dict_metadata if fqn in chosen]
    return suspects


def warn_if_planning_is_slow(path, seconds: float, plans: list, stall_timeout: float) -> None:
    """The coordinator's part of DCP's planning took ``seconds`` (from its own local plan to the
    global plans of every rank): warn past half of ``stall_timeout``. The other ranks waited as
    long in DCP's scatter, on a group that gives up after ``stall_timeout`` when
    ``checkpoint_process_group`` made it (the TorchTitan manager's); a first save's planning
    grows with every rank's chunks, so a larger job may cross it."""
    if seconds <= SLOW_PLANNING_SHARE * stall_timeout:
        return
    items = sum(len(p.items) for p in plans)
    log.warning(
        "dcp_datastates: checkpoint %s: the global plan took %.1f s after the coordinator's local plan (the plans of %d "
        "ranks, %d items, gathered and planned), and every other rank waited as long in DCP's collective; a group "
        "made by checkpoint_process_group() (the TorchTitan manager's) gives up after stall_timeout (%g s): keep "
        "stall_timeout above the planning of the largest first save (docs/configuration.md, \"When a node stops\")",
        path, seconds, len(plans), items, stall_timeout)
