"""DCP's ``FileSystemWriter`` / ``FileSystemReader`` (and ``FsspecWriter`` / ``FsspecReader``)
replaced by ours, wherever DCP names them.

The subclasses below take the stock constructors' arguments; those with no meaning for
dcp_datastates are dropped (``DROPPED`` records them): ``single_file_per_rank`` (one file per
rank and flush thread here), ``per_thread_copy_ahead``, ``cache_staged_state_dict`` (staging is
ours), ``_extensions`` / ``serialization_format`` (our data files are safetensors, checksummed,
never transformed) and the reader's ``_extension_registry``. ``thread_count`` becomes our
``flush_threads``; ``sync_files`` and ``overwrite`` mean what they mean in stock DCP.
"""

from __future__ import annotations

import sys

import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as storage_utils  # picks a storage for checkpoint_id
import torch.distributed.checkpoint.filesystem as filesystem
import torch.distributed.checkpoint.format_utils as format_utils
import torch.distributed.checkpoint.state_dict_loader as loader
import torch.distributed.checkpoint.state_dict_saver as saver

try:  # subclasses the stock classes when imported: imported first, so its classes keep them
    import torch.distributed.checkpoint.hf_storage  # noqa: F401
except ImportError:
    pass
try:  # _storage_utils imports the fsspec classes from here when it picks a storage for a URL
    import torch.distributed.checkpoint._fsspec_filesystem as fsspec_filesystem
except ImportError:  # fsspec not installed
    fsspec_filesystem = None

from dcp_datastates import DataStatesReader, DataStatesWriter

STOCK_WRITER, STOCK_READER = filesystem.FileSystemWriter, filesystem.FileSystemReader
STOCK_FSSPEC_WRITER = getattr(fsspec_filesystem, "FsspecWriter", None)
STOCK_FSSPEC_READER = getattr(fsspec_filesystem, "FsspecReader", None)
DROPPED: dict[str, object] = {}


def _drop(name: str, value, default) -> None:
    if value is not default and value != default:
        DROPPED[name] = value


class FileSystemWriter(DataStatesWriter):
    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False, overwrite=True,
                 _extensions=None, serialization_format=None, **options) -> None:
        _drop("single_file_per_rank", single_file_per_rank, True)
        _drop("per_thread_copy_ahead", per_thread_copy_ahead, 10_000_000)
        _drop("cache_staged_state_dict", cache_staged_state_dict, False)
        _drop("_extensions", _extensions, None)
        _drop("serialization_format", serialization_format, None)
        super().__init__(path, sync_files=sync_files, thread_count=thread_count, overwrite=overwrite, **options)


class FileSystemReader(DataStatesReader):
    def __init__(self, path, _extension_registry=None) -> None:
        _drop("_extension_registry", _extension_registry, None)
        super().__init__(path)


class FsspecWriter(FileSystemWriter):
    """The stock fsspec writer's extra keyword arguments are fsspec's own (``url_to_fs``):
    our ``storage_options``."""

    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, overwrite=True, _extensions=None,
                 serialization_format=None, **fs_kwargs) -> None:
        super().__init__(path, single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
                         overwrite=overwrite, _extensions=_extensions, serialization_format=serialization_format,
                         **({"storage_options": fs_kwargs} if fs_kwargs else {}))


class FsspecReader(DataStatesReader):
    def __init__(self, path, **fs_kwargs) -> None:
        super().__init__(path, **({"storage_options": fs_kwargs} if fs_kwargs else {}))


def install() -> None:
    """Every loaded DCP module that holds the stock classes by name gets ours (hf_storage's own
    subclasses excluded: they were built on the stock ones)."""
    modules = [dcp, filesystem, storage_utils, format_utils, saver, loader]
    modules += [fsspec_filesystem] if fsspec_filesystem is not None else []
    modules += [m for n, m in sys.modules.items() if n.startswith("torch.distributed.checkpoint") and m is not None
                and not n.endswith("hf_storage")]
    for module in modules:
        if getattr(module, "FileSystemWriter", None) is STOCK_WRITER:
            module.FileSystemWriter = FileSystemWriter
        if getattr(module, "FileSystemReader", None) is STOCK_READER:
            module.FileSystemReader = FileSystemReader
        if STOCK_FSSPEC_WRITER is not None and getattr(module, "FsspecWriter", None) is STOCK_FSSPEC_WRITER:
            module.FsspecWriter = FsspecWriter
        if STOCK_FSSPEC_READER is not None and getattr(module, "FsspecReader", None) is STOCK_FSSPEC_READER:
            module.FsspecReader = FsspecReader
