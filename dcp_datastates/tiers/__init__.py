"""Multi-level checkpoints: the node-local tier in front of the durable checkpoint path, composed
around the plain save and load through fixed hooks (``local_tier``), and the drain that copies
a committed local checkpoint to durable storage (``drain``)."""

from __future__ import annotations

from .hooks import NoTier, ReadPlan
from .layered import LocalTier

__all__ = ["tier_for", "NoTier", "LocalTier", "ReadPlan"]


def tier_for(config, *, saving: bool = False) -> NoTier:
    """The tier object of a writer (``saving``) or reader with this configuration."""
    return NoTier(config, saving=saving) if config.local_tier is None else LocalTier(config, saving=saving)
