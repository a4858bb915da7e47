"""The write: what ``write_data`` does for this rank on DCP's thread, once the global plan is
known.

1. held files learn which of their items this rank writes (the plan's items);
2. items the plan gives this rank that it did not stage are written now from live memory
   (``dcp.save``; another planner's layout; a cached ownership decision that changed), unless
   the version guard says they changed since the request (then the save fails);
3. wait until every file is durable and collect each item's final location (checksums too);
4. files staged into a folder DCP renamed (``reset``) are moved there;
5. a custom planner's data hooks are applied to the request-time values (``planner_hooks``):
   the items whose bytes they change go into one more file;
6. the ownership decision is learnt (or forgotten when the plan changed).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import find_state_dict_object

from ..commit import is_committed
from ..errors import CheckpointWriteError
from ..format.layout import data_file_name, name_to_dtype
from ..format.locations import ItemLocation, moved
from ..runtime import get_engine
from ..storage import Storage
from .in_flight import StagedSave
from .items import ItemKey, item_key, item_keys, source_for_resolved
from .ownership import decisions
from .planner_hooks import items_to_rewrite, overridden_data_hooks
from .request import hold, hold_limit, planned, submit_file
from .tier_events import FilesNamed
from .version_guard import torn_message

__all__ = ["write_rank", "check_rank_local", "skip_replicas"]


def check_rank_local(storage: Storage, path: str) -> None:
    """A rank-local save (``use_collectives=False``) into a folder holding a global commit: DCP's
    load reads that commit before any rank-local one, so this save would never be read back.
    Refused rather than let a load return the old values."""
    if is_committed(storage):
        raise CheckpointWriteError(
            f"{path} holds a checkpoint committed by all ranks together; a rank-local save "
            f"(use_collectives=False) there would be shadowed by it when loading. Save rank-local "
            f"checkpoints into a folder of their own."
        )


def skip_replicas(staged: StagedSave, plan: SavePlan) -> SavePlan:
    """Leave replicated DTensor shards to the replica that staged them, so any planner's dedup
    (DCP's default included) has exactly one candidate."""
    if not (plan.usable and staged.request.skipped):
        return plan
    skipped = staged.request.skipped
    return dataclasses.replace(plan, items=[i for i, key in zip(plan.items, item_keys(plan.items)) if key not in skipped])


def write_rank(staged: StagedSave, plan: SavePlan, planner: SavePlanner, config, tier) -> list[WriteResult]:
    """This rank's items of ``plan`` durable in its folder: DCP's write results. The tier hears
    of each file made here (``FilesNamed`` with the coordinator's word, ``plan.storage_data``)."""
    def named(files: tuple) -> None:
        tier.files_named(FilesNamed(staged, staged.storage, files, plan.storage_data, staged.moved_from is not None))

    if staged.error is not None:
        raise staged.error
    if staged.abandoned is not None:
        raise CheckpointWriteError(f"checkpoint {staged.path} abandoned: {staged.abandoned}")
    # Once: every step below reuses them.
    keys = item_keys(plan.items)
    given = set(keys)
    for h in staged.held:
        if not h.selection_known():
            h.set_selection(frozenset(k for k in h.keys if k in given))
    staged_keys = {k for f in staged.files for k in f.keys} | {k for h in staged.held for k in h.keys}
    late_keys = [(item, key) for item, key in zip(plan.items, keys) if key not in staged_keys]
    late = [item for item, _ in late_keys]
    if late:
        _write_late(staged, late, planner, config, named)
    locations = _wait_durable(staged)
    if staged.request.incremental is not None:
        # What changed: the next save's hint.
        staged.request.incremental.learn()
    if staged.moved_from is not None:
        locations = _relocate(staged, locations)
    if staged.flat is not None and overridden_data_hooks(planner):
        # Lazy save, custom planner: its hooks now.
        mine = [item for item, key in zip(plan.items, keys) if key in staged_keys]
        locations.update(_rewrite_for_planner(staged, mine, planner, locations, config, named))
    # The save holds no reference to the state from here on.
    staged.flat, staged.payloads = None, {}
    if staged.request.decision_key is not None:
        if staged.request.learn:
            decisions().learn(staged.request.decision_key, frozenset(k for k in given if k in staged.request.plain_keys))
        elif any(key in staged.request.elsewhere for _, key in late_keys):
            # The plan changed: hold and relearn next time.
            decisions().forget(staged.request.decision_key)
    out = []
    for item, key in zip(plan.items, keys):
        loc = locations[key]
        out.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
    return out


def _wait_durable(staged: StagedSave) -> dict[ItemKey, ItemLocation]:
    """Every file of the save durable: its items' locations; every file's error when some failed."""
    locations: dict[ItemKey, ItemLocation] = {}
    errors = []
    for f in staged.jobs():
        try:
            f.written = f.result()
            locations.update(f.written)
        except CheckpointWriteError as exc:
            errors.append(str(exc))
    if errors:
        raise CheckpointWriteError(f"saving checkpoint {staged.path} failed: " + "; ".join(errors))
    if staged.abandoned is not None:
        # Abandoned after its files were durable: still never committed.
        raise CheckpointWriteError(f"checkpoint {staged.path} abandoned: {staged.abandoned}")
    return locations


def _write_late(staged: StagedSave, late: list, planner: SavePlanner, config, named) -> None:
    """Items the plan gives this rank that it did not stage: written now from live memory,
    which for a lazy save is right only if the tensor did not change. In an incremental save
    (``dcp.save`` stages nothing) they are copied into the host cache first and written only
    where their hashes changed, when they fit in half the cache. The file joins the save's
    (``staged.held`` or ``staged.files``)."""
    guard = staged.late_guard
    for item in late:
        changed = guard.changed(item.index.fqn) if guard is not None else None
        if changed is not None:
            if staged.request.decision_key is not None:
                decisions().forget(staged.request.decision_key)
            raise CheckpointWriteError(
                torn_message(staged.path or "(unnamed)", item.index.fqn, *changed)
                + " (DCP's planner gave this rank a tensor another rank wrote last time: the ranks' "
                "state structures changed; the next checkpoint plans anew.)"
            )
    taken: set[str] = set()
    sources = [source_for_resolved(item, planner.resolve_data(item), taken) for item in late]
    engine = get_engine(config)
    index = len(staged.files) + len(staged.held)
    if staged.request.incremental is not None and sum(s.entry.nbytes for s in sources) <= hold_limit(config):
        held = hold(engine, sources, known=True, config=config, label=staged.path, incremental=staged.request.incremental,
                    copy_limit=config.copy_at_request_max_bytes)
        held.set_destination(staged.storage, data_file_name(staged.request.rank, index, staged.tag), sync=config.sync_files,
                             direct_writes=config.direct_writes, direct_io=staged.request.direct_io)
        staged.held.append(held)
        return
    staged.files.append(submit_file(engine, staged, planned(engine, index, sources), config, named))


def _relocate(staged: StagedSave, locations: dict[ItemKey, ItemLocation]) -> dict[ItemKey, ItemLocation]:
    """Move the files written into ``staged.moved_from`` to the folder DCP named (their new
    names follow that folder's commit state)."""
    renamed: dict[str, str] = {}
    for f in staged.files:
        new = data_file_name(staged.request.rank, f.index, staged.tag)
        staged.moved_from.move(f.name, staged.storage, new)
        renamed[f.name] = new
        f.name = new
    return {k: moved(loc, renamed.get(loc.file, loc.file)) for k, loc in locations.items()}


def _rewrite_for_planner(staged: StagedSave, items: list, planner: SavePlanner, locations: dict[ItemKey, ItemLocation],
                         config, named) -> dict[ItemKey, ItemLocation]:
    """A custom planner's data hooks on this lazy save (planner_hooks.py): the items whose data
    it changes go into one more file, durable before the commit; their new locations."""
    def staged_bytes(fqn: str) -> bytes | None:
        buf = staged.payloads.get(fqn)
        return None if buf is None else buf.numpy().tobytes()

    def read_back(item) -> torch.Tensor:
        loc = locations[item_key(item.index)]
        with staged.storage.open_read(loc.file) as f:
            f.seek(loc.offset)
            raw = f.read(loc.length)
        if len(raw) != loc.length:
            raise CheckpointWriteError(f"{staged.path}/{loc.file}: short read of item {item.index.fqn!r} "
                                       f"({len(raw)} of {loc.length} bytes)")
        dtype = name_to_dtype(loc.dtype)
        if not raw:
            return torch.empty(loc.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(loc.shape)

    rewrite = items_to_rewrite(planner, items, staged_bytes,
                               lambda item: find_state_dict_object(staged.flat, item.index), read_back)
    if not rewrite:
        return {}
    taken: set[str] = set()
    engine = get_engine(config)
    sources = [source_for_resolved(item, data, taken) for item, data in rewrite]
    job = submit_file(engine, staged, planned(engine, len(staged.files) + len(staged.held), sources), config, named)
    staged.files.append(job)
    return job.result()
