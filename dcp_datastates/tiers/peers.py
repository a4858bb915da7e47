"""Peer copies (``peer_copies=1`` with ``local_tier``, several ranks): once a rank's data files of a
save are durable on its node's local tier, they get a verified copy in the local tier of a rank
on another node. A node that dies then takes no file with it that another node cannot serve: the
reader finds the copy like any other file of that node's local copy (``local_tier.local_files``).

Who sends to whom (``PeerMap``). Nodes are named by ``DCPDS_NODE`` when set (tests run several
"nodes" on one machine, each with its own local tier), else by the host name. With the nodes in
sorted order, the j-th rank of a node sends to the j-th rank (modulo their count) of the next
node, the last node to the first; a rank receives from every rank that sends to it. One node
alone has no peer: nothing is copied (a warning says so once).

The group. Copies travel over a gloo process group of the library's own, made once per process
when the first writer with ``peer_copies`` is constructed (``join``; every rank constructs its
writers in the same order, on its training thread, so the group is made in the same order
everywhere), with ``peer_timeout`` as its timeout. Nothing travels inside DCP's collectives nor
on the training thread: one thread per process runs the exchanges, one per save, in save order
(``exchange``); every rank takes part in each, with or without files to send.

The wire (``peer_wire.py``), per exchange and per sender: a length-prefixed JSON manifest
(checkpoint id, durable path, sender rank and node, per file: local and durable name, size, and
every checksum piece as the save recorded it), then per file its bytes in blocks (each prefixed
with its length; -1: the sender could not read its own file, which it verifies piece by piece
while reading as the drain does), then the CRC32C of the whole file as sent. Memory in flight: the sender's read-ahead
blocks and one block on the receiver (16 MiB each).

Mirrored files (DTensor replicas, save/ownership.py): when the receiver is itself a replica of
the shards in a sender's file, it staged the same file from its own memory at the same save
(``kept``). The manifest marks such a file ``mirror``; the receiver compares its own copy with the
sender's recorded checksum pieces, size and the CRC32C of the bytes between the pieces (the
header), and when all match keeps its own copy as the sender's file: no byte of it travels. Else
(replicas that differ, another layout) it asks for the bytes as for any file. Right after the
manifest, the receiver answers with the names it wants (``_REPLY``).

The receiver writes each file under a temporary name in its own local copy of the checkpoint,
checks every checksum piece in the block that holds it and the whole file's CRC32C, fsyncs, and
only then renames it into place; it then records the files it accepted as that rank's
(``.tier-<sender>.json``, with ``peer_of``: the sender's node), which is what makes them
readable. A file that fails a check is dropped with a warning naming the sender, the file and
the piece; the others stand.

Failures never reach training nor the save: the save's durable commit does not wait for its peer
copies (``peer_copy``, a Future per save, says how they went). A peer that is slow or gone fails
the exchange after ``peer_timeout`` seconds; the group is then out of step, so this process stops
making peer copies (a warning says why) and later saves are committed as without them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..forking import ThreadPool, new_locks_in_child
from ..runtime import get_engine
from ..save.ownership import Mirroring
from ..storage import open_storage
from . import local_tier as tiers
from .file_copy import pieces_by_file
from .peer_wire import OutOfStep, between_pieces_crc, receive_file, recv_json, send_file, send_json

log = logging.getLogger("dcp_datastates")

__all__ = ["NODE_ENV", "node_name", "PeerMap", "join", "shares", "exchange", "current", "wait_peer_copies", "both_ways",
           "mirroring"]

NODE_ENV = "DCPDS_NODE"
_REPLY = 0x5EF  # the receiver's answer to a manifest (the names it wants), receiver -> sender


def node_name() -> str:
    """This process's node: ``DCPDS_NODE`` when set, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class PeerMap:
    """The node of every global rank, and who sends its files to whom (computed once: a few
    thousand ranks ask it at every exchange)."""

    nodes: tuple[str, ...]
    _targets: tuple = field(init=False, repr=False, compare=False)
    _sources: dict = field(init=False, repr=False, compare=False)
    _by_node: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(rank)
        order = sorted(by_node)
        targets: list[int | None] = [None] * len(self.nodes)
        sources: dict[int, list[int]] = {}
        if len(order) > 1:
            for i, node in enumerate(order):
                theirs = by_node[order[(i + 1) % len(order)]]
                for j, rank in enumerate(by_node[node]):
                    targets[rank] = theirs[j % len(theirs)]
                    sources.setdefault(targets[rank], []).append(rank)
        object.__setattr__(self, "_targets", tuple(targets))
        object.__setattr__(self, "_sources", sources)
        object.__setattr__(self, "_by_node", by_node)

    def ranks_on(self, node: str) -> list[int]:
        """The ranks on ``node``, in rank order."""
        return list(self._by_node.get(node, []))

    def target(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s copies (on the next node); None with one node."""
        return self._targets[rank]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose copies ``rank`` keeps, in rank order."""
        return list(self._sources.get(rank, []))


@dataclass
class _Peers:
    group: object
    map: PeerMap
    rank: int
    #: The default process group it was made in (a new one needs a new peer group).
    world: object
    #: Why this process stopped making peer copies.
    broken: str | None = None


_peers: _Peers | None = None
_peers_lock = threading.Lock()
new_locks_in_child(globals(), "_peers_lock")
# The exchanges, one at a time, in save order (every rank runs the same sequence).
_exchanges = ThreadPool(max_workers=1, thread_name_prefix="dcp-datastates-peers")


def join(config) -> None:
    """Every rank, on its training thread, when a writer with ``peer_copies`` is made: the
    library's gloo group and every rank's node, once per process (a collective on the default
    group's store). Without an initialized process group there is nothing to join."""
    global _peers
    if not (dist.is_available() and dist.is_initialized()):
        return
    with _peers_lock:
        if _peers is not None and _peers.world is dist.group.WORLD:
            return
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.peer_wait()))
        nodes: list = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node_name(), group=group)
        _peers = _Peers(group, PeerMap(tuple(str(n) for n in nodes)), dist.get_rank(), dist.group.WORLD)
    if _peers.map.target(_peers.rank) is None:
        log.warning("dcp_datastates: peer_copies: every rank runs on node %r, so there is no other node to keep "
                    "copies (set %s to tell nodes apart); local copies are not replicated", node_name(), NODE_ENV)


def mirroring() -> Mirroring | None:
    """Who keeps this rank's copies and whose it keeps (for the mirrored files the request
    plans), or None without a peer group or another node."""
    if _peers is None or _peers.map.target(_peers.rank) is None:
        return None
    return Mirroring(_peers.map.target(_peers.rank), frozenset(_peers.map.sources(_peers.rank)))


def current() -> _Peers:
    """This process's peer group (after ``join``); RuntimeError when there is none."""
    if _peers is None:
        raise RuntimeError("peer_copies: no peer group (torch.distributed is not initialized)")
    return _peers


def wait_peer_copies(timeout: float | None = None) -> bool:
    """Wait until every exchange submitted so far in this process has ended (before a process
    exits, or destroys its process groups, while its last save's copies may still travel);
    False on timeout."""
    try:
        _exchanges.submit(lambda: None).result(timeout=timeout)
    except TimeoutError:
        return False
    return True


def shares(local: str, locations: dict, renamed: dict[str, str], jobs=()) -> tuple[dict, dict]:
    """What a rank's exchange sends and keeps: ``exchange``'s ``files`` and ``kept`` for its data
    files in ``local`` (``locations``: DCP's index -> location; ``renamed``: local -> durable
    name; ``jobs``: the save's files, for the mirrored ones and those kept for other ranks)."""
    pieces = pieces_by_file(locations)
    mirrored = {f.name for f in jobs if f.mirrors}
    files = {name: (renamed[name], os.stat(os.path.join(local, name)).st_size, pieces.get(name, []),
                    name in mirrored) for name in renamed}
    kept = {}
    for f in jobs:
        if f.mirror_of is not None:
            # (Its locations are keyed by item key: DCP's index for pieces_by_file.)
            written = {MetadataIndex(key[0], key[1]): loc for key, loc in (f.written or {}).items()}
            kept[f.mirror_of] = (f.name, os.stat(os.path.join(local, f.name)).st_size,
                                 pieces_by_file(written).get(f.name, []))
    return files, kept


def exchange(local: str, durable: str, save_id: str, files: dict, config, *, coordinator: int = 0,
             metadata: Future | None = None, kept: dict | None = None) -> Future:
    """After this rank's files of checkpoint ``save_id`` are durable in its local copy ``local``:
    send them to its peer and keep the copies its peers send, on the peer thread. ``files``:
    {local name: (durable name, size, pieces, mirrored)} with pieces (offset, length, crc32c,
    item); ``kept``: {sender rank: (local name, size, pieces)} of the files this rank staged as
    the mirrors of its senders' mirrored files. The Future resolves with {"sent": [...] (whose
    bytes went), "mirrored": [...] (those the peer kept from its own replicas), "kept": [...]
    (the copies kept here), "bytes_sent", "metadata": arrived or not, "ended":
    time.monotonic() at the end}, or fails with the reason the copies could not be made
    (the save itself is not affected). Then rank ``coordinator``
    hands every rank the checkpoint's encoded metadata (its ``metadata`` Future: set when the
    coordinator has it, None when the save failed), which each node keeps in its local copy
    (``PEER_METADATA``): a restart then needs nothing from the durable store."""
    done: Future = Future()
    _exchanges.submit(_run, local, durable, save_id, files, config, coordinator, metadata, kept or {}, done)
    return done


def _run(local: str, durable: str, save_id: str, files: dict, config, coordinator: int, metadata: Future | None,
         kept: dict, done: Future) -> None:
    peers = _peers
    try:
        if peers is None:
            raise RuntimeError("peer_copies: no peer group (torch.distributed was not initialized when the writer "
                               "was made)")
        if peers.broken is not None:
            raise RuntimeError(f"peer_copies: stopped earlier in this process: {peers.broken}")
        result = _exchange(peers, local, durable, save_id, files, config, kept)
        try:
            result["metadata"] = _share_metadata(peers, local, coordinator, metadata, config)
        except OutOfStep as exc:
            # The files stand; later exchanges do not.
            _stop(peers, exc)
            result["metadata"] = False
        # (time.monotonic() of this process: benchmarks compare it)
        result["ended"] = time.monotonic()
        done.set_result(result)
    except Exception as exc:  # noqa: BLE001 - reported on the Future and logged; training goes on
        if isinstance(exc, OutOfStep):
            _stop(peers, exc)
        done.set_exception(exc)


def _stop(peers: _Peers | None, exc: BaseException) -> None:
    """The group is out of step: this process makes no more peer copies (every other rank stops
    too, at its next exchange: each one waits for every rank)."""
    if peers is not None and peers.broken is None:
        peers.broken = str(exc)
        log.warning("dcp_datastates: peer copies stop in this process (checkpoints are still saved and drained): %s",
                    exc)


def _exchange(peers: _Peers, local: str, durable: str, save_id: str, files: dict, config, kept: dict) -> dict:
    target = peers.map.target(peers.rank)
    (sent, mirrored), received = both_ways(
        lambda: _send(peers, target, local, durable, save_id, files, config) if target is not None else ([], []),
        lambda: [name for source in peers.map.sources(peers.rank)
                 for name in _receive(peers, source, save_id, config, kept.get(source))])
    for name, _, _ in kept.values():
        # A mirror the sender did not use (one it used was renamed).
        open_storage(local).remove_quietly(name)
    return {"sent": sent, "mirrored": mirrored, "kept": received, "bytes_sent": sum(files[n][1] for n in sent)}


def both_ways(send, receive) -> tuple:
    """(``send()``, ``receive()``), the first on a thread of its own while this one receives:
    every rank sends and receives at once, so neither waits for the other. The sender's error is
    raised once the receives have ended (the receiver's at once, after the sender ended)."""
    out: list = []

    def sending() -> None:
        try:
            out.append(send())
        except BaseException as exc:  # noqa: BLE001 - raised below, after the receives
            out.append(exc)

    sender = threading.Thread(target=sending, name="dcp-datastates-peers-send")
    sender.start()
    try:
        received = receive()
    finally:
        sender.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0], received


def _share_metadata(peers: _Peers, local: str, coordinator: int, metadata: Future | None, config) -> bool:
    """The coordinator's encoded metadata of this checkpoint, to every rank; each node's lowest
    rank keeps it in its local copy. The coordinator waits for it at most half ``peer_timeout``
    (its ranks' copies are done, so it comes as soon as DCP has gathered every rank's results),
    then hands on nothing, so the other ranks are never left waiting out of step. True when the
    node holds it now."""
    data = None
    if peers.rank == coordinator and metadata is not None:
        try:
            data = metadata.result(timeout=config.peer_wait() / 2)
        except Exception:  # noqa: BLE001 - the save failed or took longer: no metadata this time
            data = None
    box = [data]
    try:
        dist.broadcast_object_list(box, src=coordinator, group=peers.group)
    except Exception as exc:  # noqa: BLE001 - gloo's own errors (timeout, connection closed)
        raise OutOfStep(f"receiving the checkpoint's metadata from rank {coordinator}: {exc}") from exc
    if box[0] is None:
        return False
    if min(peers.map.ranks_on(peers.map.nodes[peers.rank])) == peers.rank:
        open_storage(local).put(tiers.PEER_METADATA, box[0], sync=config.sync_files)
    return True


def _send(peers: _Peers, dst: int, local: str, durable: str, save_id: str, files: dict,
          config) -> tuple[list[str], list[str]]:
    """(the files whose bytes were sent, those ``dst`` kept from its own replicas)."""
    order = sorted(files)
    engine = get_engine(config)
    entries = []
    for n in order:
        durable_name, size, pieces, mirrored = files[n]
        entry = {"name": n, "durable": durable_name, "size": size, "pieces": [[p[0], p[1], p[2], p[3]] for p in pieces]}
        if mirrored:
            try:
                entry["mirror"] = between_pieces_crc(os.path.join(local, n), size, pieces, engine)
            except OSError:
                # Unreadable here: offered as a plain copy, which send_file then aborts.
                pass
        entries.append(entry)
    manifest = json.dumps({"save_id": save_id, "durable": durable, "rank": peers.rank,
                           "node": peers.map.nodes[peers.rank], "files": entries}).encode()
    send_json(peers, dst, manifest, "the manifest")
    wanted = set(recv_json(peers, dst, "the names it wants", tag=_REPLY))
    store = open_storage(local)
    sent = [name for name in order
            if name in wanted and send_file(peers, dst, store, name, files[name][1], files[name][2], engine)]
    return sent, [name for name in order if name not in wanted]


def _receive(peers: _Peers, src: int, save_id: str, config, mirror: tuple | None) -> list[str]:
    """Keep the copies rank ``src`` sends in this exchange; the names of the files accepted.
    ``mirror``: (local name, size, pieces) of the file this rank staged as the mirror of
    ``src``'s mirrored file, or None."""
    manifest = recv_json(peers, src, "a manifest")
    try:
        files, durable, sender = manifest["files"], manifest["durable"], int(manifest["rank"])
    except (KeyError, TypeError, ValueError) as exc:
        raise OutOfStep(f"rank {src} sent a manifest that does not read: {exc}") from exc
    if manifest.get("save_id") != save_id or sender != src:
        raise OutOfStep(f"rank {src} sent the copies of checkpoint {manifest.get('save_id')} (rank {sender}) "
                         f"while this rank is at checkpoint {save_id}")
    folder = tiers.local_copy(config.local_tier, durable)
    for f in files:
        name = f["name"]
        if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
            raise OutOfStep(f"rank {src} sent a copy named {name!r}")
    engine = get_engine(config)
    mirrored = _matching_mirror(folder, files, mirror, engine)
    send_json(peers, src, json.dumps([f["name"] for f in files if f["name"] != mirrored]).encode(),
               "the names this rank wants", tag=_REPLY)
    tiers.ensure_copy(folder, durable)
    # Its record never names a file being replaced.
    tiers.forget_rank_files(folder, sender)
    kept = {}
    store = open_storage(folder)
    for f in files:
        name = f["name"]
        if name == mirrored:
            try:
                # This rank's own replica of it, checked: kept as the sender's.
                store.move(mirror[0], store, name)
                kept[name] = f["durable"]
            except OSError as exc:
                # Its bytes were not asked for: no copy of it this time.
                log.warning("dcp_datastates: peer_copies: keeping this rank's replica of %s as rank %d's failed: %s",
                            name, src, exc)
        elif receive_file(peers, src, folder, name, int(f["size"]), f["pieces"], engine, config):
            kept[name] = f["durable"]
    if kept:
        tiers.record_rank_files(folder, sender, durable, save_id, kept, peer_of=manifest.get("node"))
    return sorted(kept)


def _matching_mirror(folder: str, files: list, mirror: tuple | None, engine) -> str | None:
    """The name of the sender's mirrored file when this rank's own mirror of it (``mirror``) holds
    the same bytes: the same size, checksum pieces and bytes between them; else None."""
    if mirror is None:
        return None
    local_name, size, pieces = mirror
    for f in files:
        if "mirror" not in f:
            continue
        theirs = [tuple(p) for p in f["pieces"]]
        mine = [tuple(p) for p in pieces]
        if int(f["size"]) != size or theirs != mine:
            log.info("dcp_datastates: peer_copies: this rank's replica of %s differs from the sender's (size or "
                     "checksums): its bytes are copied", f["name"])
            return None
        try:
            same = between_pieces_crc(os.path.join(folder, local_name), size, pieces, engine) == f["mirror"]
        except OSError:
            same = False
        if not same:
            log.info("dcp_datastates: peer_copies: the header of %s differs from this rank's replica: its bytes are "
                     "copied", f["name"])
        return f["name"] if same else None
    return None
