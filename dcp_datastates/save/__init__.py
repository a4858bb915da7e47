"""The save, as named steps, in the order a save runs them (each module tells its step):

1. ``request``: on the training thread, ``stage()``: flatten and scan the state once (``scan``,
   non-tensor values serialized by ``values``), plan this rank's files (``planning.plan_stage``:
   the plan types in ``plan``, reused from ``plan_cache`` while the state's structure holds; on a
   miss ``items``, ``ownership`` and ``file_groups``), copy small items now (``copy_at_request``),
   submit each planned file to the storage's engine job, hold what cannot be written yet
   (``held_file``), register the save (``runtime.inflight``) (``incremental``: an incremental
   save's held files write only the items whose hashes changed since the base checkpoint); a
   watcher seals the version guard (``version_guard.VersionGuard``) and resolves DCP's Future; the
   save in flight is ``in_flight.StagedSave``, a ``in_flight.FileJob`` per data file (the copy
   at the request into ``side_buffers``);
2. ``request.name_folder`` / ``request.sync_save``: DCP names the folder; on the coordinator,
   DCP's global plan (``global_plan``: its dedup and validation at a C-level cost per item, for
   ``planners.DataStatesSavePlanner``; a warning when the planning nears ``stall_timeout``);
3. ``write``: on DCP's thread, ``write_data``: every file durable, late items, the planner's
   data hooks (``planner_hooks``), the items' locations; ``consolidate``: results rank -> node
   leader -> coordinator;
4. the commit (``commit.write_commit``, through the tier's hook), then ``finish.close_save``:
   the save leaves the registry and records its figures (``checkpoint_stats``);
5. ``discard``: a save that fails, on any rank, has what it wrote here removed.

The DCP adapter (``writer.py``) calls only what this package exports.
"""

# The files of saves still running: a commit keeps them.
from ..runtime.inflight import names_in_use
from .consolidate import consolidate_results
from .discard import CommitNotice, discard, unwatch, wait_settled, watch
from .finish import close_save
from .global_plan import warn_if_planning_is_slow
from .in_flight import StagedSave
from .request import global_rank_world, name_folder, request_save, sync_save
from .write import check_rank_local, skip_replicas, write_rank

__all__ = ["request_save", "name_folder", "sync_save", "write_rank", "check_rank_local", "skip_replicas",
           "consolidate_results", "close_save", "global_rank_world", "StagedSave", "names_in_use",
           "discard", "watch", "unwatch", "wait_settled", "CommitNotice", "warn_if_planning_is_slow"]
