"""Finding TorchTitan's DCP ``CheckpointManager`` without failing, and saying why when it is not found.

``dcp_datastates.integrations.torchtitan`` asks here once, at import: each module that may hold
the manager is tried in turn, and every error is kept, so the ``ImportError`` raised when the
manager is used names what to install, or which modules were tried and why each failed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# Where TorchTitan keeps its DCP CheckpointManager, newest first: ``checkpointer`` (0.3.0 and
# main) and the legacy ``checkpoint`` (0.3.0 re-exports it; main removed it in #4184). Both
# export the same names, so the first that imports is used.
_CHECKPOINT_MODULES = ("torchtitan.components.checkpointer", "torchtitan.components.checkpoint")
_NAMES = ("CheckpointManager", "AsyncMode", "DATALOADER", "MODEL")


def _import_torchtitan() -> tuple[str | None, tuple[Any, ...] | None, list[str]]:
    """The module the manager comes from, its names (``_NAMES`` and ``GarbageCollection``), and
    one line per module tried that failed (its error), so a failure says what was tried."""
    tried: list[str] = []
    for name in _CHECKPOINT_MODULES:
        # Any error, not only ImportError: a TorchTitan incompatible with this torch raises others.
        try:
            module = importlib.import_module(name)
            found = tuple(getattr(module, n) for n in _NAMES)
            from torchtitan.tools.utils import GarbageCollection
        except Exception as exc:  # noqa: BLE001 - reported by _missing_error(), never raised at import
            tried.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        return name, (*found, GarbageCollection), tried
    return None, None, tried


def _torchtitan_location() -> str | None:
    """Where the ``torchtitan`` package would be imported from; None when it is not installed."""
    try:
        spec = importlib.util.find_spec("torchtitan")
    except (ImportError, ValueError):
        # A broken or stubbed sys.modules entry.
        return None
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or ()) or spec.name


def _missing_error(tried: list[str]) -> ImportError:
    """The error raised when the manager is used without TorchTitan's: ``tried`` is what
    ``_import_torchtitan`` reported."""
    install = (
        "Install it with `pip install --no-deps torchtitan` plus its light dependencies "
        "(`pip install tyro spmd_types`), or follow TorchTitan's installation guide."
    )
    where = _torchtitan_location()
    if where is None:
        return ImportError(
            "dcp_datastates.integrations.torchtitan needs TorchTitan, which is not installed "
            f"(tried {', '.join(_CHECKPOINT_MODULES)}). {install}"
        )
    return ImportError(
        f"dcp_datastates.integrations.torchtitan needs TorchTitan's DCP CheckpointManager, which could not be "
        f"imported from the TorchTitan at {where}; tried {'; '.join(tried)}. Supported: TorchTitan 0.3.0 and "
        f"main (see the module's docstring). {install}"
    )
