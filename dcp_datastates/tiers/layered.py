"""LocalTier: each save committed on the node-local tier first, then drained to the durable path.

The tier protocol (``plain.py``) filled for ``local_tier=DIR``: each rank writes and
commits into its node's local copy of the checkpoint (``local_tier.py``), whose files are copied
to the durable path while they are written and drained after the local commit (``drain.py``),
to a peer's node as well with ``peer_copies`` (``peers.py``); a load reads the nearest good copy.
The tier keeps what it needs of each save in flight itself (a ``_SaveCopies`` per save).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..commit import prepare_folder, write_commit
from ..errors import CheckpointWriteError
from ..forking import ThreadPool
from ..format.layout import new_tag
from ..format.locations import moved, split_reference
from ..machine import usable_cpus
from ..save import global_rank_world
from ..save.tier_events import BEFORE_PLAN, Claim, Destination, FilesNamed, RankEnded
from ..storage import Storage, open_storage, root_of
from . import drain, file_copy, peers
from . import local_tier as tiers
from . import pending as pending_ckpt
from .node_copies import NodeCopies
from .plain import NoTier
from .records import RankDrain, ReadPlan, SoloDrain

log = logging.getLogger("dcp_datastates")

__all__ = ["LocalTier"]

# Several ranks: each rank's drain of its files (drain.drain_rank), off DCP's thread so the
# coordinator can gather while ranks drain.
_drainers = ThreadPool(max_workers=2, thread_name_prefix="dcp-datastates-drain")
# One rank: the durable folder prepared at the request and its copies started (files_named),
# off the request's own threads, whose end staging waits for (the durable store may be slow).
_early = ThreadPool(max_workers=1, thread_name_prefix="dcp-datastates-drain-early")
# A failed save's discard waits this long for its drain to end before removing its copies.
_DRAIN_END_WAIT_S = 30.0
# The coordinator's words (RankDrain, SoloDrain) this process acted on, with their saves (weak):
# each save gets its word afresh, so one met again in another save is a replay (_refuse_replayed).
_words_taken: deque = deque(maxlen=64)
_words_lock = threading.Lock()
# One rank: the local copies evicted (keep_local) while the save's own drain runs.
_evictors = ThreadPool(max_workers=1, thread_name_prefix="dcp-datastates-evict")

@dataclass
class _SaveCopies:
    """What ``LocalTier`` keeps of one save in flight: the plan the coordinator handed on, the
    durable copies started while its files are written, and when its local copy was committed.

    - ``plan``: RankDrain, SoloDrain or None (``global_plan``'s word to this rank).
    - ``followed``: local file name -> its copy to the durable tier (``file_copy.follow``).
    - ``early``: the copies started at the request, before DCP planned (``files_named``).
    - ``reconciled``: ``early`` was matched against the plan (once, when the plan came).
    - ``local_s``: request -> the local copy committed or recorded.
    """

    plan: object = None
    followed: dict = field(default_factory=dict)
    early: Future | None = None
    reconciled: bool = False
    local_s: float | None = None


class LocalTier(NoTier):
    """``local_tier=DIR``: each rank writes and commits into its node's local copy of the
    checkpoint, which is then drained to the durable path (local_tier.py)."""

    def __init__(self, config, *, saving: bool = False) -> None:
        super().__init__(config, saving=saving)
        # save id -> this rank's drain of it and its heartbeat (several ranks)
        self._drains: dict[str, tuple[Future, drain.Heartbeat]] = {}
        # What this tier keeps of each save in flight, for as long as the save exists.
        self._saves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # peer_copies: who keeps whose copies, for the mirrored files the request plans.
        self._mirroring = None
        if saving and config.peer_copies:
            # A writer: every rank makes one, on its training thread.
            peers.join(config)
            self._mirroring = peers.mirroring()

    def destination(self, path: str | None) -> Destination:
        """The node's local copy of ``path``, made once ``claimed`` made room for it (off the
        training thread); rank-local saves are refused (the drain needs the coordinator)."""
        if path is not None:
            self.durable_path = path
        folder = None if path is None else tiers.local_copy(self.config.local_tier, path)
        refused = (f"local_tier: rank-local saves (use_collectives=False) are not supported (saving "
                   f"{self.durable_path}); save without local_tier, or with collectives")
        return Destination(folder, self.durable_path, folder_at_request=False, rank_local_refused=refused,
                           mirroring=self._mirroring)

    def _of(self, key) -> "_SaveCopies":
        """This tier's record of the save ``key`` (made at its first event)."""
        record = self._saves.get(key)
        if record is None:
            record = self._saves[key] = _SaveCopies()
        return record

    def claimed(self, event: Claim) -> None:
        """Room for the save on the local tier; the copy names its durable path (a restart's
        ``drain_pending`` reads it); what this rank recorded there and what a restart agreed on
        are forgotten (a record must never name files being rewritten)."""
        if event.need is not None:
            tiers.make_room(self.config.local_tier, event.need(), event.folder, self.config.storage_options)
        tiers.record_durable(event.folder, self.durable_path)
        tiers.forget_rank_files(event.folder, event.rank)
        tiers.forget_restart(event.folder)

    def files_named(self, event: FilesNamed) -> None:
        """Before DCP plans, one rank alone: the early copies (``_copy_early``). From
        ``write_data`` on: each file is copied to the durable tier as it is written
        (``file_copy.follow``), unless the request started its copy already under the plan DCP
        agreed on; the drain takes a copy only if its checksums match the save's."""
        if event.plan is BEFORE_PLAN:
            self._start_early(event)
            return
        self._refuse_replayed(event.plan, event.key)
        record = self._of(event.key)
        record.plan = event.plan
        if not record.reconciled:
            record.reconciled = True
            early = self._early_copies(event.key)
            if early is not None:
                plan, followed = early
                if record.plan == plan:
                    # (global_plan handed it on: same folder, not moved)
                    record.followed.update(followed)
                else:
                    # DCP named another folder (reset), or planned without the request's plan.
                    _cancel(followed, "the save's durable files are named otherwise")
        self._follow(record, event)

    def _refuse_replayed(self, word, key: object) -> None:
        """A plan cache (DCP's ``SavePlanner`` with ``enable_plan_caching=True``) hands a rank
        the plan of the save that filled it, its ``storage_data`` included, instead of this
        save's: the word of an earlier save (its id and its file names' tag). Acting on it would
        record this save's files under the other's id and name them by its tag, so the save
        fails here, on every rank through DCP, before a file is copied."""
        if key is None or not isinstance(word, (RankDrain, SoloDrain)):
            return
        with _words_lock:
            for taken, save in _words_taken:
                if taken is word:
                    if save() is key:
                        return
                    raise CheckpointWriteError(
                        f"checkpoint {self.durable_path}: this rank was handed an earlier save's plan (a save "
                        "planner's plan cache, enable_plan_caching=True), without this save's word from the "
                        "coordinator (its id and file names); with local_tier, save with DataStatesSavePlanner "
                        "(it carries each save's word) or a planner without plan caching. Nothing of this save "
                        "is committed."
                    )
            _words_taken.append((word, weakref.ref(key)))

    def _start_early(self, event: FilesNamed) -> None:
        """One process saving alone: its files are copied to the durable tier before DCP plans,
        into the durable folder prepared here, whose plan ``global_plan`` hands on; from the
        first chunk where the machine has cores to spare (``_cores_to_spare``), else from the end
        of staging (docs/how-it-works.md, "Copied while written"). Several ranks wait for the
        coordinator's plan (the names' tag, the folder's checks) and start at ``write_data``."""
        if self.durable_path is None or global_rank_world()[1] != 1 or not event.files:
            return
        try:
            self._of(event.key).early = _early.submit(self._copy_early, event.storage, event.files, self.durable_path)
        except RuntimeError as exc:
            # The interpreter is shutting down: copied after the local commit.
            log.info("dcp_datastates: %s: copies not started at the request (%s)", self.durable_path, exc)

    def _copy_early(self, storage: Storage, files: tuple, durable: str) -> tuple | None:
        """(SoloDrain, {local name: Follower}), or None when the durable folder could not be
        prepared (then as without: prepared at planning, or drained after the local commit)."""
        try:
            plan = SoloDrain(drain.prepare_durable(durable, self.config), durable)
            followed = file_copy.follow(storage, files, durable, plan.tag, self.config,
                                    from_staged=not _cores_to_spare(self.config))
        except Exception as exc:  # noqa: BLE001 - the local save never fails for the durable tier
            log.info("dcp_datastates: %s not prepared at the request (%s); prepared at planning", durable, exc)
            return None
        return plan, followed

    def _early_copies(self, key) -> tuple | None:
        """What ``_copy_early`` started for the save ``key`` (waited for: it only prepares and
        submits)."""
        record = self._saves.get(key) if key is not None else None
        early = record.early if record is not None else None
        return early.result() if early is not None else None

    def global_plan(self, plans: list, save_id: str, key: object, moved: bool) -> list:
        """Several ranks: each rank drains its own files; the coordinator names them. One rank:
        the durable folder is prepared now unless the request prepared it (``files_named``),
        so that its files can be copied while they are written; if it cannot be, the drain after
        the local commit tries again (the local commit never waits for the durable tier)."""
        if len(plans) <= 1:
            early = self._early_copies(key)
            if early is not None and early[0].durable == self.durable_path and not moved:
                return [dataclasses.replace(p, storage_data=early[0]) for p in plans]
            try:
                return [dataclasses.replace(p, storage_data=SoloDrain(
                    drain.prepare_durable(self.durable_path, self.config), self.durable_path)) for p in plans]
            except Exception as exc:  # noqa: BLE001 - the store's own errors too
                log.info("dcp_datastates: %s not prepared before the local commit (%s); drained after it",
                         self.durable_path, exc)
                return plans
        durable = open_storage(self.durable_path, self.config.storage_options)
        committed = prepare_folder(durable, overwrite=self.config.overwrite)
        # New names next to a commit, or next to a pending checkpoint whose drained files a
        # restart may still read.
        pending = pending_ckpt.read_pending(durable) is not None
        plan = RankDrain(save_id, new_tag() if committed or pending else None, global_rank_world()[0])
        return [dataclasses.replace(p, storage_data=plan) for p in plans]

    def _follow(self, record: _SaveCopies, event: FilesNamed) -> None:
        plan = record.plan
        # (Files staged into another folder are moved at the end of write_data: drained after.)
        if isinstance(plan, (RankDrain, SoloDrain)) and event.storage is not None and not event.moved:
            # (Those followed since the request are followed already.)
            files = [f for f in event.files if f.name not in record.followed]
            try:
                started = file_copy.follow(event.storage, files, self.durable_path, plan.tag, self.config)
            except Exception as exc:  # noqa: BLE001 - the local save never fails for the durable tier
                log.info("dcp_datastates: %s: files not copied while written (%s); drained after the local commit",
                         self.durable_path, exc)
                return
            record.followed.update(started)

    def rank_ended(self, event: RankEnded) -> list:
        """This rank's part ended: its files durable (``_rank_written``) or failed (``_rank_failed``)."""
        if event.error is not None:
            self._rank_failed(event)
            return []
        return self._rank_written(event)

    def _rank_written(self, event: RankEnded) -> list:
        """Several ranks: this rank's files are durable on the local tier. Record them in the
        local copy, then drain them on a drain thread (it reports to the coordinator, which
        commits once every rank did); the results name the durable files."""
        results = list(event.results)
        record = self._of(event.key)
        plan = record.plan
        if not isinstance(plan, RankDrain):
            return results
        # The rank in the data file names (global: the coordinator waits for the writers of the
        # files it commits, local_tier.file_ranks), not the rank in DCP's process group.
        # (An incremental save's references name durable files already: not this rank's to drain.)
        locations = {r.index: r.storage_data for r in results if split_reference(r.storage_data.file) is None}
        renamed = {loc.file: file_copy.durable_name(loc.file, plan.tag) for loc in locations.values()}
        tiers.record_rank_files(event.folder, event.rank, self.durable_path, plan.save_id, renamed)
        record.local_s = time.monotonic() - event.requested
        if not self.local_commit.done():
            self.local_commit.set_result(event.folder)
        self._drains = {k: d for k, d in self._drains.items() if not d[0].done()}
        beat = drain.Heartbeat(open_storage(self.durable_path, self.config.storage_options), event.rank,
                               plan.save_id, self.config.stall_timeout / 4)
        try:
            queued = _drainers.submit(drain.drain_rank, event.folder, self.durable_path, locations, renamed,
                                      plan.save_id, event.rank, self.config, record.followed, beat)
        except BaseException:
            beat.stop()
            raise
        self._drains[plan.save_id] = (queued, beat)
        if self.config.peer_copies:
            self._copy_to_peer(event.folder, plan, locations, renamed, event.rank, event.files)
        return [dataclasses.replace(r, storage_data=moved(r.storage_data, renamed.get(r.storage_data.file,
                                                                                        r.storage_data.file)))
                for r in results]

    def _rank_failed(self, event: RankEnded) -> None:
        """The copies started at the request stop. peer_copies: this rank still takes its part
        in the save's exchange, with nothing to send, so that every rank's exchanges stay in
        step (the next save's copies are made)."""
        early = self._early_copies(event.key)
        if early is not None:
            _cancel(early[1], "the save failed")
        plan = self._of(event.key).plan
        if self.config.peer_copies and isinstance(plan, RankDrain) and self._exchanged != plan.save_id \
                and event.folder is not None:
            try:
                self._copy_to_peer(event.folder, plan, {}, {}, event.rank)
            except Exception as exc:  # noqa: BLE001 - the save's own error is the one raised
                log.warning("dcp_datastates: peer_copies: could not take part in the failed save's exchange: %s", exc)
        # A coordinator that failed has no metadata to hand on.
        self._hand_metadata(None)

    def discard(self, key: object, folder: str | None, rank: int, remove_files) -> None:
        """What the failed save wrote goes: the copies to the durable tier started while its files
        were written, then its files in the local copy. Kept: a checkpoint committed on the local
        tier (one rank: the local commit stands, the drain that failed removed its own copies;
        several ranks: the coordinator recorded it as pending, restorable from the local copies,
        and the next save drains it). Several ranks whose drain had started: that drain's
        durable copies and report go with the local files and this rank's record."""
        record = self._of(key)
        plan = record.plan
        if record.local_s is None:
            # Nothing committed or recorded on the local tier yet.
            self._stop_copies(key)
            remove_files()
            return
        if not isinstance(plan, RankDrain):
            # One rank: committed locally.
            return
        durable = open_storage(self.durable_path, self.config.storage_options)
        pending = pending_ckpt.read_pending(durable)
        if pending is not None and pending[0].storage_meta.save_id == plan.save_id:
            # Its drained copies are the pending checkpoint's: kept too.
            return
        self._stop_copies(key)
        drained = self._drains.pop(plan.save_id, None)
        if drained is not None:
            queued, beat = drained
            if queued.cancel():
                # Never started: nothing to wait for, no report to come.
                beat.stop()
            try:
                queued.exception(timeout=_DRAIN_END_WAIT_S)
            except Exception:  # noqa: BLE001 - still copying: its files go all the same
                pass
        record = tiers.rank_record(folder, rank)
        tiers.forget_rank_files(folder, rank)
        if record is not None and record.get("save_id") == plan.save_id:
            for name in record.get("files", {}):
                durable.remove_quietly(name)
        durable.remove_quietly(pending_ckpt.drain_report_name(rank))
        remove_files()

    def _stop_copies(self, key) -> None:
        """The copies to the durable tier started while the save's files were written stop, and
        what they wrote goes."""
        early = self._early_copies(key)
        followers = [*(early[1].values() if early is not None else ()), *self._of(key).followed.values()]
        for follower in followers:
            follower.cancel("the save failed")
        deadline = time.monotonic() + _DRAIN_END_WAIT_S
        for follower in followers:
            follower.wait_ended(max(0.0, deadline - time.monotonic()))

    #: The save whose exchange this tier started last.
    _exchanged: str | None = None

    def _copy_to_peer(self, local: str, plan: RankDrain, locations: dict, renamed: dict[str, str], rank: int,
                      jobs=()) -> None:
        """This rank's files, durable in the local copy, go to its peer (peers.py), and every node
        gets the checkpoint's metadata from the coordinator once it has it; ``peer_copy`` says
        how that went. The save never waits for it. ``jobs``: the save's files, for the mirrored
        ones (sent only if the keeper's own copy differs) and those kept here for other ranks."""
        files, kept = peers.shares(local, locations, renamed, jobs)
        self._exchanged = plan.save_id
        self._metadata_for_peers = Future() if rank == plan.coordinator else None
        done = peers.exchange(local, self.durable_path, plan.save_id, files, self.config,
                              coordinator=plan.coordinator, metadata=self._metadata_for_peers, kept=kept)
        target = self.peer_copy

        # Into the save's own Future, which callers may hold already.
        def settle(f: Future) -> None:
            if not target.done():
                if f.exception() is not None:
                    target.set_exception(f.exception())
                else:
                    target.set_result(f.result())

        done.add_done_callback(settle)

    def commit(self, storage: Storage, metadata, locations, key: object, requested: float | None, *,
               rank_local: int | None, in_use: frozenset) -> dict:
        config = self.config
        record = self._of(key) if key is not None else _SaveCopies()
        if isinstance(record.plan, RankDrain):
            return self._commit_drained(metadata, locations, record.plan)
        # An incremental save builds on the durable checkpoints beside it, and its references
        # name their (durable) files, so a local copy holds only its own files, the drain copies
        # only those, and evicting local copies never removes bytes a kept checkpoint refers to.
        beside = open_storage(self.durable_path, config.storage_options) if self.durable_path else None
        files = write_commit(storage, metadata, locations, sync=config.sync_files, rank_local=rank_local,
                             in_use=in_use, references_beside=beside)
        if requested is not None:
            record.local_s = time.monotonic() - requested
        self.local_commit.set_result(storage.location)
        if config.peer_copies and not self.peer_copy.done():
            self.peer_copy.set_exception(RuntimeError(
                f"peer_copies: {self.durable_path} was saved by one process: there is no other node to copy to"))
        plan = record.plan
        # Its files were copied while written (writing()).
        prepared = isinstance(plan, SoloDrain)
        # Older copies beyond keep_local go while this one drains, not after: removing a copy
        # frees its memory, which on tmpfs takes time in proportion to its size. Each goes only
        # if its durable folder holds it, whatever this drain does; this copy, the newest, is kept.
        evicting = _evictors.submit(tiers.evict_drained, config.local_tier, config.keep_local, config.storage_options)
        try:
            drain.drain(storage.location, self.durable_path, config, plan.tag if prepared else drain.UNPREPARED,
                        record.followed if prepared else None, committed=(metadata, locations, files))
            # left by a killed run, under the same root (so on the store these options are for)
            drained = drain.drain_pending_quietly(config.local_tier, config, root=root_of(self.durable_path))
        except BaseException:
            # (Waited for; the drain's error is the one raised.)
            evicting.exception()
            raise
        evicting.result()
        if drained:
            # Durable only now: past keep_local, they go too.
            tiers.evict_drained(config.local_tier, config.keep_local, config.storage_options)
        return files

    def _commit_drained(self, metadata, locations: dict, plan: RankDrain) -> dict:
        """Several ranks: every rank's files are on its node's local tier. Record the
        checkpoint's metadata in the durable folder (restorable from the local copies from here
        on), wait for every rank's drain report, then commit the durable folder."""
        durable = open_storage(self.durable_path, self.config.storage_options)
        encoded = pending_ckpt.write_pending(durable, metadata, locations, sync=self.config.sync_files)
        self._hand_metadata(encoded)
        ranks = pending_ckpt.file_ranks(locations)
        pending_ckpt.wait_drained(durable, plan.save_id, ranks, self.config.drain_timeout, self.config.stall_timeout)
        files = write_commit(durable, metadata, locations, sync=self.config.sync_files)
        pending_ckpt.clear_pending(durable, ranks)
        return files

    def _hand_metadata(self, encoded: bytes | None) -> None:
        """peer_copies, the coordinator: what its exchange hands every node (None: nothing)."""
        waiting = getattr(self, "_metadata_for_peers", None)
        if waiting is not None and not waiting.done():
            waiting.set_result(encoded)

    def ended(self, key: object, error: BaseException | None) -> float | None:
        """A failed save's ``local_commit`` fails (unless its local copy was committed) and the
        coordinator's peer exchange learns it has no metadata to hand on."""
        if error is not None:
            if not self.local_commit.done():
                self.local_commit.set_exception(error)
            self._hand_metadata(None)
        record = self._saves.get(key) if key is not None else None
        return None if record is None else record.local_s

    # ---------------------------------------------------------------------------------- load
    def choose(self, path: str) -> ReadPlan:
        """The nearest good copy: this node's local copy when complete, verified and tied to
        the durable commit; a checkpoint committed only on the local tiers (several ranks,
        drain interrupted) through its pending metadata; else the durable folder, whose data
        files this node may still hold (several ranks)."""
        config = self.config
        self.durable_path = path
        agreed = tiers.agreed_at_restart(config.local_tier, path)
        if agreed is not None:
            md, files = agreed
            log.info("dcp_datastates: reading checkpoint %s of %s as every rank agreed at the restart "
                     "(prepare_restart): its metadata and files from the local copies", md.storage_meta.save_id, path)
            return ReadPlan(path, agreed, md.storage_meta.save_id, tiers.local_copy(config.local_tier, path))
        chosen = tiers.choose_copy(path, config)
        local = tiers.local_copy(config.local_tier, path)
        if chosen != path:
            return ReadPlan(chosen)
        pending = pending_ckpt.read_pending(path, config.storage_options, uncommitted_only=True)
        if pending is not None:
            md, _ = pending
            log.info("dcp_datastates: %s is committed on the nodes' local tiers and not yet on the durable "
                     "tier: reading checkpoint %s from the local copies", path, md.storage_meta.save_id)
            return ReadPlan(path, pending, md.storage_meta.save_id, local)
        return ReadPlan(path, local=local)

    def node_copies(self, plan: ReadPlan, save_id: str | None, rank: int) -> NodeCopies:
        return NodeCopies(tiers.local_files(plan.local, save_id) if plan.local is not None else {}, rank=rank)


def _cores_to_spare(config) -> bool:
    """True when the process may use more CPUs than the engine's copy and flush threads, the
    training thread and a follower's reader and writer take."""
    return usable_cpus() >= config.copy_threads + config.flush_threads + 3


def _cancel(followed: dict, reason: str) -> None:
    for follower in followed.values():
        follower.cancel(reason)
