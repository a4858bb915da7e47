"""The commit protocol: ``.metadata`` is the commit marker, written last and atomically, and a
checkpoint path always holds one good checkpoint: the old one until the new one is committed.

- ``reading``: what a committed checkpoint is (its marker, read safely and decoded; its data
  files present with their sizes, an incremental save's references to an earlier checkpoint's
  files resolved), the newest one under a root, its checkpoint id.
- ``writing``: preparing a folder for a save, committing a checkpoint whose data is durable,
  removing what the new commit made obsolete.

It works on any ``Storage`` and knows nothing of tiers: the node-local tier commits its copy
and the durable one through these same functions.
"""

from .reading import (
    by_folder,
    check_commit,
    check_data_files,
    checkpoint_id,
    data_file,
    file_size_error,
    is_committed,
    latest_checkpoint,
    read_commit,
    referenced_by,
    step_folders,
)
from .writing import prepare_folder, write_commit

__all__ = ["read_commit", "check_data_files", "file_size_error", "check_commit", "is_committed", "latest_checkpoint",
           "checkpoint_id", "prepare_folder", "write_commit", "data_file", "by_folder", "referenced_by", "step_folders"]
