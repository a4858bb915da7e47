"""Storage: where a checkpoint's files live, behind one interface (``Storage``).

``open_storage(location, storage_options)`` is the one place that decides between a folder of
this machine (``LocalStorage``: fsync, atomic rename, safe opens) and any fsspec file system
(``ObjectStorage``: one-PUT small files). It is called once per checkpoint path; the save, the
load, the commit protocol and the tiers receive the ``Storage`` and never ask which kind they
hold. A storage is folders only: the engine writes and reads its data files through the data
channel (``dcp_datastates.channel``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .base import Storage
from .local import LocalStorage, file_kind, not_regular_error, open_for_reading
from .objectstore import ObjectStorage
from .paths import is_remote, is_supported_url, local_path, normalize, root_of

__all__ = ["Storage", "LocalStorage", "ObjectStorage", "open_storage", "normalize", "is_supported_url",
           "open_for_reading", "file_kind", "not_regular_error", "root_of"]


def open_storage(location: "str | os.PathLike | Storage", storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of a checkpoint folder: a local path or ``file://`` URL -> ``LocalStorage``;
    any other URL -> ``ObjectStorage`` through fsspec (``storage_options`` passed to it). A
    ``Storage`` is returned as it is."""
    if isinstance(location, Storage):
        return location
    if is_remote(location):
        return ObjectStorage(os.fspath(location), storage_options)
    return LocalStorage(local_path(location))
