"""A restart with peer copies (``prepare_restart``): every rank agrees on one checkpoint to resume
from and the nodes' local tiers get the files their ranks will read, pulled from the other nodes'
copies (peers.py), so a node that was lost and replaced reads its data from its peers instead of
the durable store.

Every rank calls it with the same arguments, before ``dcp.load``. Over the peer group:

1. Rank 0 lists the candidates under ``root``, newest step first: folders holding a durable
   commit, or the pending metadata of a checkpoint committed only on the nodes' local tiers;
   for each, in turn, it reads the metadata and hands it to every rank.
2. One rank per node (the lowest) verifies, piece by piece against that metadata, every file
   its node's local tier holds of that checkpoint (its own ranks' files and the peer copies it
   kept). A file that does not verify is named in a warning and set aside (renamed
   ``<name>.corrupt``): it is never loaded.
3. A candidate is taken when each of its data files is held, verified, by some node, or it is
   committed on the durable tier (which then serves what no node holds). Otherwise every rank
   moves on to the next candidate together: the decision is made from what every rank gathered.
4. Each node then pulls the files its ranks will read and it lacks, each from the lowest rank
   holding it: with ``state_dict``, the files DCP's default load planner reads for it on each
   rank; without, the files the node held before (its ranks' own, and those of the ranks whose
   copies it keeps). A pulled file is verified as a peer copy is, and recorded as its writer's.

It returns the checkpoint's path (the same on every rank), or None when there is none. The
metadata is read from the durable store (by rank 0 here, and by ``dcp.load``); data files that
some node holds are not.
"""

from __future__ import annotations

import json
import logging
import os

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..config import DataStatesConfig
from ..errors import DataStatesError, RestartError
from ..format.document import MAX_METADATA_BYTES
from ..format.layout import METADATA_NAME, PENDING_NAME, STEP_NUMBER, data_file_parts
from ..format.locations import own_files
from ..format.metadata import decode_metadata
from ..runtime import get_engine
from ..storage import normalize, open_storage
from . import local_tier as tiers
from . import peer_wire, peers
from .file_copy import copy_verified, pieces_by_file

log = logging.getLogger("dcp_datastates")

__all__ = ["prepare_restart"]


def prepare_restart(root: str | os.PathLike, *, local_tier: str | os.PathLike, state_dict: dict | None = None,
                    config=None, **options) -> str | None:
    """Every rank, before ``dcp.load``: the checkpoint under ``root`` to resume from, agreed by
    every rank, with the files this node's ranks will read brought to its local tier from the
    other nodes' peer copies (module docstring). ``state_dict``: what this rank will load (then
    exactly the files it reads are pulled). Needs an initialized process group."""
    config = DataStatesConfig.resolve(config, {**options, "local_tier": os.fspath(local_tier), "peer_copies": 1})
    peers.join(config)
    group = peers.current()
    root = normalize(root)
    candidates = _from_rank0(group, lambda: _candidates(root, config))
    for path, committed in candidates:
        found = _metadata(group, path, committed, config)
        if found is None:
            continue
        md, files, encoded = found
        required = sorted(own_files(files))
        gathered = _from_each(group, _verify_held, group, path, md, files, config)
        holders: dict[str, list[int]] = {}
        for rank, names in enumerate(gathered):
            for name in names:
                holders.setdefault(name, []).append(rank)
        missing = [name for name in required if name not in holders]
        if missing and not committed:
            if group.rank == 0:
                log.warning("dcp_datastates: restart: %s is committed only on the local tiers and no node holds a "
                            "verified copy of %s; trying the next checkpoint", path, ", ".join(missing[:5]))
            continue
        _pull(group, path, md, files, holders, state_dict, config)
        _from_each(group, _agree, group, path, md, encoded, config)
        if group.rank == 0:
            log.info("dcp_datastates: restart: every rank resumes from %s (%d of its %d files held on the nodes' "
                     "local tiers%s)", path, len(required) - len(missing), len(required),
                     "" if not missing else "; the rest are read from the durable tier")
        return path
    return None


def _from_rank0(group, make, *args):
    """``make(*args)`` on rank 0, handed to every rank; its error raised on every rank."""
    box = [_outcome(make, *args) if group.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group.group)
    return _unwrap([box[0]])


def _from_each(group, make, *args) -> list:
    """Every rank's ``make(*args)``, on every rank; any rank's error raised on every rank."""
    gathered: list = [None] * len(group.map.nodes)
    dist.all_gather_object(gathered, _outcome(make, *args), group=group.group)
    return _unwrap(gathered, many=True)


def _outcome(make, *args) -> tuple:
    try:
        return ("ok", make(*args))
    except Exception as exc:  # noqa: BLE001 - handed to every rank, raised there
        return ("error", f"{type(exc).__name__}: {exc}")


def _unwrap(outcomes: list, many: bool = False):
    for rank, (status, value) in enumerate(outcomes):
        if status == "error":
            raise RestartError(f"prepare_restart failed on rank {rank}: {value}" if many else
                               f"prepare_restart failed on rank 0: {value}")
    values = [value for _, value in outcomes]
    return values if many else values[0]


def _is_leader(group) -> bool:
    return min(group.map.ranks_on(group.map.nodes[group.rank])) == group.rank


def _candidates(root: str, config) -> list[tuple[str, bool]]:
    """(folder, committed durably) of the folders under ``root`` holding a durable commit or a
    pending checkpoint, newest step first (names and existence only: nothing is read)."""
    store = open_storage(root, config.storage_options)
    found = []
    for name in store.subfolders():
        m = STEP_NUMBER.search(name)
        folder = store.child(name)
        if m:
            committed = folder.has(METADATA_NAME)
            if committed or folder.has(PENDING_NAME):
                found.append((int(m.group(1)), folder.location, committed))
    return [(path, committed) for _, path, committed in sorted(found, reverse=True)]


def _metadata(group, path: str, committed: bool, config):
    """(Metadata, files, encoded) of the checkpoint in ``path``, the same on every rank: the copy
    a node kept (``PEER_METADATA``, handed out by the coordinator at the save), from the lowest
    rank holding one that decodes; else read by rank 0 from the durable store (its commit, else
    its pending metadata); None when there is none."""
    kept = _from_each(group, _kept_metadata, group, path, config)
    holder = next((rank for rank, has in enumerate(kept) if has), None)
    if holder is not None:
        box = [_kept_metadata(group, path, config, raw=True) if group.rank == holder else None]
        dist.broadcast_object_list(box, src=holder, group=group.group)
        encoded = box[0]
    else:
        encoded = _from_rank0(group, _durable_metadata, path, committed, config)
    if encoded is None:
        return None
    md, files = decode_metadata(encoded, f"{path}/{PENDING_NAME if not committed else METADATA_NAME}")
    return md, files, encoded


def _kept_metadata(group, path: str, config, raw: bool = False):
    """This node's kept metadata of ``path``, checked to decode (its lowest rank answers): True /
    False, or the bytes with ``raw``."""
    if not _is_leader(group):
        return None if raw else False
    where = os.path.join(tiers.local_copy(config.local_tier, path), tiers.PEER_METADATA)
    try:
        with open(where, "rb") as f:
            data = f.read()
        decode_metadata(data, where)
    except (OSError, DataStatesError):
        return None if raw else False
    return data if raw else True


def _durable_metadata(path: str, committed: bool, config) -> bytes | None:
    store = open_storage(path, config.storage_options)
    for name in ((METADATA_NAME, PENDING_NAME) if committed else (PENDING_NAME,)):
        try:
            return store.read_small(name, limit=MAX_METADATA_BYTES, what="the commit marker")
        except Exception:  # noqa: BLE001 - absent or unreadable: the next one, or none
            continue
    return None


def _agree(group, path: str, md, encoded: bytes, config) -> None:
    """Each node's lowest rank records in its local copy the checkpoint every rank agreed on,
    with its metadata: ``dcp.load`` with ``local_tier`` then reads it from there (nothing from
    the durable store) until a save writes into that copy again."""
    if not _is_leader(group):
        return
    local = tiers.local_copy(config.local_tier, path)
    tiers.ensure_copy(local, path)
    store = open_storage(local)
    store.put(tiers.PEER_METADATA, encoded, sync=config.sync_files)
    store.put(tiers.RESTART_FILE, json.dumps({"save_id": md.storage_meta.save_id}).encode(), sync=config.sync_files)


def _verify_held(group, path: str, md, files: dict, config) -> list[str]:
    """The data files of ``md`` this node holds whole and verified (checked by its lowest rank;
    the others report none); a copy that fails is named in a warning and renamed
    ``<name>.corrupt`` (never loaded)."""
    if not _is_leader(group):
        return []
    local = tiers.local_copy(config.local_tier, path)
    held = tiers.local_files(local, md.storage_meta.save_id)
    pieces = pieces_by_file(md.storage_data)
    engine = get_engine(config)
    store = open_storage(local)
    good = []
    for name, where in sorted(held.items()):
        info = files.get(name)
        if info is None:
            continue
        local_name = os.path.basename(where)
        try:
            if os.path.getsize(where) != info.size:
                raise ValueError(f"{os.path.getsize(where)} bytes, the checkpoint records {info.size}")
            copy_verified(store, local_name, _Discard(), info.size, pieces.get(name, []), engine)
        except Exception as exc:  # noqa: BLE001 - damaged, truncated or unreadable: not a copy to load
            log.warning("dcp_datastates: restart: the copy of %s of %s on node %s does not verify (%s); set aside "
                        "as %s.corrupt, never loaded", name, path, group.map.nodes[group.rank], exc, where)
            try:
                os.replace(where, where + ".corrupt")
            except OSError:
                pass
            continue
        good.append(name)
    return good


class _Discard:
    """A file object that drops what it is given (a verification pass)."""

    def write(self, block) -> int:
        return len(block)


def _needed(group, md, files: dict, state_dict: dict | None) -> list[str]:
    """The data files this rank will read: with ``state_dict``, those DCP's default load planner
    reads for it; without, this rank's own files and those of the ranks whose copies it keeps."""
    if state_dict is not None:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state_dict, md, group.rank == 0)
        plan = planner.create_local_plan()
        wanted = {md.storage_data[item.storage_index].file for item in plan.items}
    else:
        writers = {group.rank, *group.map.sources(group.rank)}
        wanted = {name for name in files if (parts := data_file_parts(name)) is not None and parts[0] in writers}
    return sorted(wanted & set(own_files(files)))


def _pull(group, path: str, md, files: dict, holders: dict[str, list[int]], state_dict, config) -> None:
    """Bring to each node the files its ranks need that it lacks, each from the lowest rank
    holding it (to the node's lowest rank)."""
    needs = _from_each(group, _needed, group, md, files, state_dict)
    nodes = group.map.nodes
    # (file, source rank, receiving rank): the same list on every rank
    pulls = []
    for node in sorted(set(nodes)):
        ranks = group.map.ranks_on(node)
        leader = min(ranks)
        wanted = sorted({name for r in ranks for name in needs[r]})
        for name in wanted:
            sources = holders.get(name, [])
            if sources and not any(nodes[s] == node for s in sources):
                pulls.append((name, min(sources), leader))
    # Gathered, so a rank whose transfer failed raises on every rank (the gather is the barrier
    # that ends the pulls).
    _from_each(group, _transfer, group, path, md, files, pulls, config)


def _transfer(group, path: str, md, files: dict, pulls: list, config) -> None:
    """This rank's part of ``pulls``: the files it sends, and those it receives (verified, then
    recorded as their writers')."""
    if not any(group.rank in (src, dst) for _, src, dst in pulls):
        return
    local = tiers.local_copy(config.local_tier, path)
    pieces = pieces_by_file(md.storage_data)
    engine = get_engine(config)
    save_id = md.storage_meta.save_id
    held = tiers.local_files(local, save_id)
    store = open_storage(local)

    def send_mine() -> None:
        for name, src, dst in pulls:
            if src == group.rank:
                peer_wire.send_file(group, dst, store, os.path.basename(held[name]), files[name].size,
                                pieces.get(name, []), engine)

    def receive_mine() -> None:
        mine = [(name, src) for name, src, dst in pulls if dst == group.rank]
        if mine:
            tiers.ensure_copy(local, path)
        kept: dict[int, dict[str, str]] = {}
        for name, src in mine:
            if peer_wire.receive_file(group, src, local, name, files[name].size, pieces.get(name, []), engine, config):
                parts = data_file_parts(name)
                kept.setdefault(parts[0] if parts is not None else -1, {})[name] = name
        for writer, names in kept.items():
            record = tiers.rank_record(local, writer)
            before = record["files"] if record is not None and record.get("save_id") == save_id else {}
            tiers.record_rank_files(local, writer, path, save_id, {**{n: d for d, n in before.items()}, **names},
                                    peer_of="restart")

    peers.both_ways(send_mine, receive_mine)
