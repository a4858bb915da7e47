"""The version guard: a source changed in place, or freed, while a lazy save copies it fails the save.

``stage()`` returns before the bytes are copied; a tensor changed in place before its copy ends
would put a mix of old and new values in the checkpoint, which its checksums (computed on the
copied bytes) cannot reveal. Every in-place change bumps a tensor's version counter (shared by
its views and ``detach()``), so ``stage()`` records each source's counter and the save is
*sealed* once its copies are done or ordered before later GPU work: the counters are compared
then, and any change fails the save with the first changed tensor's name. Reading a counter is an
attribute read per tensor (measured by ``bench``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import tensor_version, versions_of

__all__ = ["VersionGuard", "freed_message", "torn_message"]


class VersionGuard:
    """Names, tensors and their version counters at ``stage()``, in state-dict order; and, for
    the lazily copied ones, the memory the copies read."""

    __slots__ = ("names", "tensors", "versions", "_index", "owners", "addresses")

    def __init__(self, names: list[str], tensors: list[Any], versions: list | None = None,
                 owners: list | None = None, addresses: list[int] | None = None) -> None:
        """``versions``: the counters read already (None entries are not checked); else read now.
        ``owners`` / ``addresses``: per entry, the storage (or a tensor on it) the copy reads and
        the address it reads from (0: nothing), checked by ``first_freed``."""
        self.names = names
        self.tensors = tensors
        self.versions = versions if versions is not None else versions_of(tensors)
        self._index: dict[str, int] | None = None
        self.owners = owners
        self.addresses = addresses

    def first_freed(self) -> str | None:
        """The name of the first guarded tensor whose memory is no longer its storage's (the
        storage was resized: ``untyped_storage().resize_(0)`` frees it, a resize reallocates it,
        with no version bump), so a copy may have read memory reused for something else."""
        if not self.owners:
            return None
        for name, v, owner, address in zip(self.names, self.versions, self.owners, self.addresses):
            if v is None or not address:
                continue
            storage = owner.untyped_storage() if isinstance(owner, torch.Tensor) else owner
            start = storage.data_ptr()
            if not start <= address < start + storage.nbytes():
                return name
        return None

    def first_changed(self) -> tuple[str, int, int] | None:
        """(name, version at stage, version now) of the first tensor changed since, or None."""
        for name, t, v in zip(self.names, self.tensors, self.versions):
            if v is not None:
                now = tensor_version(t)
                if now != v:
                    return name, v, now
        return None

    def changed(self, name: str) -> tuple[int, int] | None:
        """(version at stage, now) when the tensor recorded under ``name`` changed, else None."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        i = self._index.get(name)
        if i is None or self.versions[i] is None:
            return None
        now = tensor_version(self.tensors[i])
        return None if now == self.versions[i] else (self.versions[i], now)

    def release(self) -> None:
        """Drop the references to the tensors (the save no longer needs them)."""
        self.tensors = []
        self.versions = []
        self.names = []
        self._index = None
        self.owners = self.addresses = None


def freed_message(path: str, name: str) -> str:
    return (
        f"checkpoint {path}: the memory of tensor {name!r} was freed or reallocated (its storage "
        f"resized, e.g. untyped_storage().resize_(0)) after the save was requested and before its "
        f"copy finished, so the copy may hold other data; it was not committed (the previous "
        f"checkpoint stays). Free or resize a tensor of the state only after the save's "
        f"staging_completion (or dcp_datastates.wait_staged())."
    )


def torn_message(path: str, name: str, before: int, after: int) -> str:
    return (
        f"checkpoint {path}: tensor {name!r} was changed in place after the save was requested and "
        f"before its copy finished (into the host cache, or the file with direct writes) "
        f"(version {before} -> {after}), so the "
        f"checkpoint would mix old and new values; it was not committed (the previous checkpoint "
        f"stays). Make optimizer.step() wait with dcp_datastates.protect_optimizer(optimizer), or "
        f"wait on the save's staging_completion (or call dcp_datastates.wait_staged()) before "
        f"changing parameters or buffers in place (EMA updates, manual p.add_(...))."
    )
