"""Config files as users write them: YAML, or JSON with ``//`` comments, read into a mapping.

JSON may carry ``//`` line comments, as in the DeepSpeed tutorial; the file's extension chooses
the parser. What the options mean is ``DataStatesConfig``'s business (``config.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_config_file", "strip_json_comments"]


def read_config_file(path: str | os.PathLike) -> Any:
    """The document in a YAML or JSON file (by extension), ``{}`` for an empty one; a file that
    does not parse raises ValueError naming the file."""
    p = Path(path)
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(strip_json_comments(text))
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file name
        raise ValueError(f"{p}: cannot parse config: {exc}") from exc
    return {} if data is None else data


def strip_json_comments(text: str) -> str:
    """Drop ``//`` line comments that sit outside strings."""
    out_lines = []
    for line in text.splitlines():
        in_str = False
        escaped = False
        cut = len(line)
        for i, ch in enumerate(line):
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = not in_str
            elif not in_str and line.startswith("//", i):
                cut = i
                break
        out_lines.append(line[:cut])
    return "\n".join(out_lines)
