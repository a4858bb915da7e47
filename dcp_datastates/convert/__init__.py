"""Converting a committed checkpoint to other formats: a consolidated Hugging Face safetensors
folder, a ``torch.save`` file, or a stock DCP checkpoint (``FileSystemWriter``).

Every item is read back through ``dcp.load`` with ``DataStatesReader`` (DCP assembles each tensor
from all ranks' shards; the reader checks every CRC32C), into new full-size CPU tensors. Outputs
are written under temporary names and renamed into place, never through a link planted in the
output folder. ``dcp-datastates convert`` is the command-line front end.

``to_hf(..., hf_config=...)`` also writes the model's ``config.json`` (and its
``generation_config.json``) so that ``from_pretrained(out)`` needs nothing else; the files are
checked as JSON objects and copied as they are (transformers is not needed here).
"""

from __future__ import annotations

import errno
import functools
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

from ..commit import check_data_files, read_commit
from ..load.verify import no_progress
from .output import _create_new, _prepare_output, _umask, _write_new_file

__all__ = ["CheckpointItem", "Converted", "checkpoint_items", "read_hf_config", "to_dcp", "to_hf", "to_torch"]

# Files of a Hugging Face safetensors folder that ``to_hf`` writes (and replaces).
_HF_NAME = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")
# What ``hf_config`` copies from a folder: the model config (required) and its generation config.
_HF_CONFIG = "config.json"
_HF_GENERATION_CONFIG = "generation_config.json"
# Bytes loaded per dcp.load call: bounds the progress granularity, not memory.
_LOAD_GROUP_BYTES = 256 << 20

# progress(total_bytes, description) -> a context manager whose value has update(nbytes).
Progress = Callable[[int, str], ContextManager[Any]]


@dataclass
class CheckpointItem:
    """One entry of a checkpoint's metadata, as tools show it. ``kind`` is "tensor" or "bytes";
    ``chunks`` holds one dict per stored chunk (for tensors: offsets, sizes, file, offset, length,
    pieces)."""

    fqn: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    requires_grad: bool
    chunks: list[dict]


@dataclass
class Converted:
    """What a conversion wrote. For ``hf`` only: ``files`` are the safetensors files written,
    ``skipped`` the items a safetensors file cannot hold, ``config_files`` the config.json
    (+ generation_config.json) written."""

    out: str
    items: int
    nbytes: int
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    config_files: list[str] = field(default_factory=list)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def checkpoint_items(md) -> list[CheckpointItem]:
    """Every item of a checkpoint's DCP ``Metadata`` with where its chunks are stored."""
    from collections import defaultdict

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from ..format.layout import dtype_to_name

    by_fqn: dict[str, list] = defaultdict(list)
    for index, loc in md.storage_data.items():
        by_fqn[index.fqn].append((index, loc))
    out = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            loc = md.storage_data[MetadataIndex(fqn)]
            chunk = {"file": loc.file, "offset": loc.offset, "length": loc.length, "pieces": len(loc.crc32c)}
            out.append(CheckpointItem(fqn, "bytes", "-", (), loc.length, False, [chunk]))
            continue
        locs = {tuple(index.offset): loc for index, loc in by_fqn[fqn]}
        chunks = []
        for c in smd.chunks:
            loc = locs.get(tuple(c.offsets))
            chunks.append(
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": None if loc is None else loc.file,
                    "offset": None if loc is None else loc.offset,
                    "length": None if loc is None else loc.length,
                    "pieces": 0 if loc is None else len(loc.crc32c),
                }
            )
        numel = 1
        for s in smd.size:
            numel *= s
        out.append(
            CheckpointItem(
                fqn,
                "tensor",
                dtype_to_name(smd.properties.dtype),
                tuple(smd.size),
                numel * _itemsize(smd.properties.dtype),
                bool(smd.properties.requires_grad),
                chunks,
            )
        )
    return out


# ----------------------------------------------------------------------------- the three formats
def to_torch(path: str, out: str, *, force: bool = False, trusted: bool = False,
             progress: Progress | None = None) -> Converted:
    """One ``torch.save`` file of the whole (nested) state. ``trusted`` decodes non-tensor
    values without restriction: it RUNS CODE FROM THE CHECKPOINT."""
    import torch

    path, md = _open_checkpoint(path, out)
    state, total = _load_state(path, md, out, force, trusted, is_dir=False, progress=progress)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with _create_new(tmp) as f:
            torch.save(state, f)
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return Converted(out, len(md.state_dict_metadata), total)


def to_dcp(path: str, out: str, *, force: bool = False, trusted: bool = False,
           progress: Progress | None = None) -> Converted:
    """A stock DCP checkpoint (``FileSystemWriter``) of the whole state, loadable without this
    library."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path, md = _open_checkpoint(path, out)
    # Non-tensor values are copied as the bytes the checkpoint holds: whatever planner wrote them
    # (DCP's torch.save, Megatron's pre-packed io.BytesIO) reads them back from the stock
    # checkpoint exactly as from this one. Unless trusted, each must pass the restricted decoder
    # first, since a stock DCP load of the output unpickles them without restriction.
    state, total = _load_state(path, md, out, force, trusted, is_dir=True, progress=progress, raw_values=True)
    dcp.save(state, storage_writer=FileSystemWriter(out), planner=_verbatim_planners()[1](), no_dist=True)
    return Converted(out, len(md.state_dict_metadata), total)


def to_hf(path: str, out: str, *, max_shard_size: int = 5 * 10**9, prefix: str | None = None,
          hf_config: str | os.PathLike | None = None, force: bool = False,
          progress: Progress | None = None) -> Converted:
    """A Hugging Face safetensors folder: ``model.safetensors`` or ``model-0000k-of-0000n``
    shards of at most ``max_shard_size`` tensor bytes, and ``model.safetensors.index.json``.
    Only tensors (under ``prefix``, which is stripped from their names); nothing is unpickled.

    ``hf_config``: a ``config.json`` file (any name), or a folder holding one (a model folder
    such as ``save_pretrained`` writes: only its ``config.json`` and, when present,
    ``generation_config.json`` are taken), written into ``out`` as they are, so that
    ``AutoModelForCausalLM.from_pretrained(out)`` (or the model's own class) loads the folder
    alone. Each must be a JSON object; a missing file raises ``FileNotFoundError``, an invalid
    one ``ValueError``, both naming the file, before the checkpoint is read."""
    from safetensors.torch import save_file

    from ..format.layout import safetensors_dtype

    if max_shard_size < 1:
        raise ValueError("max_shard_size must be positive")
    configs = read_hf_config(hf_config) if hf_config is not None else {}
    path, md = _open_checkpoint(path, out)
    progress = progress or no_progress
    # (fqn, output name, bytes) of each item chosen.
    chosen: list[tuple[str, str, int]] = []
    skipped: list[str] = []
    for item in checkpoint_items(md):
        if prefix and not item.fqn.startswith(prefix):
            continue
        name = item.fqn[len(prefix):] if prefix else item.fqn
        if item.kind != "tensor":
            skipped.append(f"{item.fqn} (not a tensor)")
            continue
        if safetensors_dtype(item.dtype) is None:
            skipped.append(f"{item.fqn} ({item.dtype} has no safetensors dtype)")
            continue
        if not name:
            raise ValueError(f"--prefix {prefix!r} leaves item {item.fqn!r} without a name")
        chosen.append((item.fqn, name, item.nbytes))
    if not chosen:
        raise ValueError(f"{path}: no tensors to convert" + (f" under prefix {prefix!r}" if prefix else ""))

    shards: list[list[tuple[str, str, int]]] = []
    size = 0
    for entry in chosen:
        if not shards or (size + entry[2] > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    _prepare_output(out, force, is_dir=True)
    # With force: no stale shards of an earlier conversion.
    for old in os.listdir(out):
        if _HF_NAME.match(old):
            os.unlink(os.path.join(out, old))
    weight_map: dict[str, str] = {}
    total = sum(e[2] for e in chosen)
    with progress(total, "convert") as bar:
        for fname, shard in zip(names, shards):
            # Tensors only: nothing unpickled.
            flat = _load_flat(path, md, [e[0] for e in shard], bar)
            tensors = {name: flat[fqn] for fqn, name, _ in shard}
            # A new, unpredictable name created here: a link planted in OUT cannot redirect it.
            fd, tmp = tempfile.mkstemp(prefix=f".{fname}.", suffix=".tmp", dir=out)
            os.close(fd)
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, os.path.join(out, fname))
            for _, name, _ in shard:
                weight_map[name] = fname
            del flat, tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index_tmp = os.path.join(out, f".model.safetensors.index.json.tmp-{os.getpid()}")
    with _create_new(index_tmp, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    # Replaces a link, never follows it.
    os.replace(index_tmp, os.path.join(out, "model.safetensors.index.json"))
    for name, data in configs.items():
        _write_new_file(out, name, data)
    return Converted(out, len(chosen), total, files=names, skipped=skipped, config_files=list(configs))


def read_hf_config(source: str | os.PathLike) -> dict[str, bytes]:
    """The Hugging Face config files ``to_hf(hf_config=source)`` writes: ``{"config.json": bytes}``
    and, when ``source`` is a folder holding one, ``"generation_config.json"``. ``source`` is a
    config file (any name) or a folder holding ``config.json``. Each is checked to be a JSON
    object (UTF-8); a missing one raises ``FileNotFoundError``, an invalid one ``ValueError``,
    each naming the file."""
    source = os.fspath(source)
    if os.path.isdir(source):
        wanted = {_HF_CONFIG: os.path.join(source, _HF_CONFIG)}
        generation = os.path.join(source, _HF_GENERATION_CONFIG)
        if os.path.lexists(generation):
            wanted[_HF_GENERATION_CONFIG] = generation
        missing = f"no {_HF_CONFIG} in the Hugging Face config folder"
    else:
        wanted = {_HF_CONFIG: source}
        missing = "Hugging Face config not found"
    out = {}
    for name, file in wanted.items():
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, missing, file) from None
        except IsADirectoryError:
            raise ValueError(f"Hugging Face config {file} is a folder, not a JSON file") from None
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"Hugging Face config {file} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"Hugging Face config {file} is not a JSON object (found a {type(doc).__name__})")
        out[name] = data
    return out


# ------------------------------------------------------------------------------------- reading
def _open_checkpoint(path: str, out: str):
    """(folder, DCP Metadata) of a committed checkpoint whose data files all exist with the sizes
    it records, checked before allocating anything the metadata describes."""
    path = os.fspath(path)
    if os.path.abspath(out) == os.path.abspath(path):
        raise ValueError("the output must not be the checkpoint itself")
    md, files = read_commit(path)
    check_data_files(path, files)
    return path, md


def _load_state(path: str, md, out: str, force: bool, trusted: bool, *, is_dir: bool,
                progress: Progress | None, raw_values: bool = False) -> tuple[dict, int]:
    """The whole nested state and its bytes; the output is created only once loading worked.
    ``raw_values``: non-tensor values come back as ``_StoredBytes`` (their stored bytes)."""
    # Fail fast: before loading anything.
    _prepare_output(out, force, is_dir=is_dir, create=False)
    keys = list(md.state_dict_metadata)
    total = sum(_sizes(md, keys).values())
    with (progress or no_progress)(total, "load") as bar:
        flat = _load_flat(path, md, keys, bar, trusted=trusted, raw_values=raw_values)
    _prepare_output(out, force, is_dir=is_dir)
    return _unflatten(flat, md.planner_data), total


def _sizes(md, keys: list[str]) -> dict[str, int]:
    """Bytes of each item as stored (a tensor's full size; a value's serialized length)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out = {}
    for k in keys:
        smd = md.state_dict_metadata[k]
        if isinstance(smd, TensorStorageMetadata):
            numel = 1
            for s in smd.size:
                numel *= s
            out[k] = numel * _itemsize(smd.properties.dtype)
        else:
            out[k] = md.storage_data[MetadataIndex(k)].length
    return out


def _groups(keys: list[str], sizes: dict[str, int], limit: int) -> Iterable[list[str]]:
    group, size = [], 0
    for k in keys:
        if group and size + sizes[k] > limit:
            yield group
            group, size = [], 0
        group.append(k)
        size += sizes[k]
    if group:
        yield group


class _StoredBytes(bytes):
    """A non-tensor value's bytes as a checkpoint stores them (``to_dcp`` copies them as they are)."""


@functools.cache
def _verbatim_planners():
    """(load planner class, save planner class) that carry stored values as bytes (torch is
    imported only when a conversion runs)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class VerbatimValuesLoadPlanner(DefaultLoadPlanner):
        """Keeps each stored non-tensor value as its bytes (no unpickling)."""

        def load_bytes(self, read_item, value) -> None:
            # DCP's own load_bytes puts the value where it belongs (torch.load of our own wrapper
            # of the stored bytes: the stored bytes themselves are never unpickled).
            wrapped = io.BytesIO()
            torch.save(_StoredBytes(value.read()), wrapped)
            wrapped.seek(0)
            super().load_bytes(read_item, wrapped)

    class VerbatimValuesSavePlanner(DefaultSavePlanner):
        """Writes ``_StoredBytes`` values as they are instead of pickling them."""

        def transform_object(self, write_item, object):
            if write_item.type == WriteItemType.BYTE_IO and isinstance(object, _StoredBytes):
                return io.BytesIO(object)
            return super().transform_object(write_item, object)

    return VerbatimValuesLoadPlanner, VerbatimValuesSavePlanner


def _load_flat(path: str, md, keys: list[str], bar, trusted: bool = False, raw_values: bool = False) -> dict[str, Any]:
    """Load ``keys`` (flat fqns) into new full-size CPU tensors; non-tensor values come back
    decoded by the restricted unpickler (with ``trusted``: unrestricted), or with ``raw_values``
    as their stored bytes (``_StoredBytes``, nothing decoded)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..config import tool_config
    from ..reader import DataStatesReader

    flat: dict[str, Any] = {}
    sizes = _sizes(md, keys)
    for k in keys:
        smd = md.state_dict_metadata[k]
        # Non-tensor values: a placeholder the planner replaces with the stored object.
        flat[k] = torch.empty(tuple(smd.size), dtype=smd.properties.dtype) if isinstance(smd, TensorStorageMetadata) else None
    for group in _groups(keys, sizes, _LOAD_GROUP_BYTES):
        part = {k: flat[k] for k in group}
        dcp.load(
            part,
            # Raw values are kept as bytes by the planner; unless trusted, the reader still checks
            # each with the restricted decoder (a stock DCP load of the output unpickles them).
            storage_reader=DataStatesReader(path, config=tool_config(), trusted=trusted),
            planner=_verbatim_planners()[0](allow_partial_load=False) if raw_values
            else DefaultLoadPlanner(allow_partial_load=False),
            no_dist=True,
        )
        # Non-tensor values were set in ``part``; tensors were filled in place.
        flat.update(part)
        bar.update(sum(sizes[k] for k in group))
    return flat


def _unflatten(flat: dict[str, Any], planner_data: dict | None) -> dict:
    """Rebuild the nested state from flat fqns with the object paths DCP recorded at save time
    (``planner_data``); keys without a recorded path stay flat."""
    out: dict = {}
    for fqn, value in flat.items():
        path = tuple(planner_data.get(fqn, ())) if planner_data else ()
        if not path:
            out[fqn] = value
            continue
        node: Any = out
        for key, nxt in zip(path[:-1], path[1:]):
            fresh: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = fresh
                node = node[key]
            else:
                node = node.setdefault(key, fresh)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return out
