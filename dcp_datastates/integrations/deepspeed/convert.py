"""Converting a DeepSpeed tag saved through DataStates to DeepSpeed's own ``torch.save`` layout.

The output folder gets one ``torch.save`` file per file DeepSpeed asked to save
(``mp_rank_00_model_states.pt``, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` ...), each
holding exactly the state dict DeepSpeed handed over, so DeepSpeed's default engine,
``zero_to_fp32`` and the universal-checkpoint converter read it as a checkpoint of their own.
``dcp-datastates convert TAG_FOLDER OUT --to deepspeed`` is the command-line front end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ...reader import DataStatesReader
from .engine import load_file
from .files import write_atomically
from .state import SEP

__all__ = ["DeepSpeedConverted", "to_deepspeed", "deepspeed_files"]


@dataclass
class DeepSpeedConverted:
    """What ``to_deepspeed`` wrote."""

    out: str
    files: list[str] = field(default_factory=list)
    nbytes: int = 0


def deepspeed_files(path: str) -> list[str]:
    """The DeepSpeed file names a committed DataStates checkpoint of a tag holds."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = DataStatesReader(os.fspath(path)).read_metadata()
    return sorted(k for k, item in md.state_dict_metadata.items() if SEP not in k and isinstance(item, BytesStorageMetadata))


def to_deepspeed(path: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                 trusted: bool = False) -> DeepSpeedConverted:
    """Write DeepSpeed's ``torch.save`` files of the tag checkpointed in ``path`` into folder
    ``out`` (created; it must be empty unless ``force``). Every tensor is read back with its
    checksum checked; values are decoded with the restricted unpickler and DeepSpeed's types
    (``trusted``: unrestricted, RUNS CODE FROM THE CHECKPOINT)."""
    path, out = os.fspath(path), os.fspath(out)
    if os.path.abspath(path) == os.path.abspath(out):
        raise ValueError("the output must not be the checkpoint itself: DeepSpeed's file names there are pointers")
    names = deepspeed_files(path)
    if not names:
        raise ValueError(f"{path}: the checkpoint holds no DeepSpeed file (was it saved by the DeepSpeed integration?)")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"output {out} exists and is not a folder")
        if os.listdir(out) and not force:
            raise ValueError(f"output folder {out} is not empty (pass --force to write into it)")
    os.makedirs(out, exist_ok=True)
    done = DeepSpeedConverted(out)
    for name in names:
        state = load_file(path, name, trusted=trusted)
        write_atomically(os.path.join(out, name), lambda f, state=state: torch.save(state, f), sync=False)
        done.files.append(name)
        done.nbytes += os.path.getsize(os.path.join(out, name))
    return done

