"""Engines for tests that drive the C++ engine directly. The engine has no defaults of its own
(every argument is required); these come from DataStatesConfig, as in the library."""

from __future__ import annotations

import dcp_datastates._engine as E
from dcp_datastates import DataStatesConfig


def engine_args(**overrides) -> dict:
    """DataStatesConfig's engine settings as Engine keyword arguments, with ``overrides``."""
    c = DataStatesConfig()
    # Two copy workers whatever the machine's default (1 on 2 CPUs): these tests exercise their races.
    args = dict(chunk_bytes=c.chunk_size, copy_threads=2, flush_threads=c.flush_threads,
                read_threads=c.read_threads, alignment=c.cache_alignment,
                cache_wait_timeout_s=float(c.cache_wait_timeout), pin=c.pin_host_cache, prefault=True)
    args.update(overrides)
    return args


def build_engine(cache_bytes: int, **overrides) -> "E.Engine":
    """An engine with a cache of ``cache_bytes``; other settings from DataStatesConfig."""
    return E.Engine(cache_bytes, **engine_args(**overrides))
