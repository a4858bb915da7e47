"""The compiled engine (``dcp_datastates._engine``, C++17 through pybind11), loaded here only.

Imported by name: import-linter reads Python sources, and would take ``from . import _engine``
for an import of the whole package (and so of every layer)."""

from __future__ import annotations

import importlib

__all__ = ["engine_module"]


def engine_module():
    """The extension module; ImportError naming the fix when the package was not built."""
    try:
        return importlib.import_module("dcp_datastates._engine")
    except ImportError as exc:  # pragma: no cover - only when the package was not built
        raise ImportError(
            "dcp_datastates' C++ engine (dcp_datastates._engine) is not built; "
            "install the package with `pip install .` (or `pip install -e .`)"
        ) from exc
