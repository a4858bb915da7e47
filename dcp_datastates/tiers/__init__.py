"""Multi-level checkpoints: the node-local tier in front of the durable checkpoint path, composed
around the plain save and load through the tier protocol (``plain.py``; the events a save sends
are ``save/tier_events.py``), and the drain that copies a committed local checkpoint to durable
storage (``drain``)."""

from __future__ import annotations

from .layered import LocalTier
from .plain import NoTier
from .records import ReadPlan

__all__ = ["tier_for", "NoTier", "LocalTier", "ReadPlan"]


def tier_for(config, *, saving: bool = False) -> NoTier:
    """The tier object of a writer (``saving``) or reader with this configuration."""
    return NoTier(config, saving=saving) if config.local_tier is None else LocalTier(config, saving=saving)
