"""Staging: what ``stage()`` derives from a state dict before the engine copies it."""
