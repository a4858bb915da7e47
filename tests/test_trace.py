"""Back-and-forth per item (issue 50): the cross-module calls a save and a load make per item of
the state, measured by scripts/trace_save.py --per-item, stay within scripts/trace_ceilings.json."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cross_module_calls_per_item_stay_within_the_ceilings(tmp_path):
    out = tmp_path / "per_item.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_save.py"), "--per-item", "60", "120",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(out.read_text())
    ceilings = json.loads((ROOT / "scripts" / "trace_ceilings.json").read_text())
    over = [f"{what} {role}: {measured[what].get(role)} cross-module calls per item, ceiling {limit}"
            for what in ("save", "load") for role, limit in ceilings[what].items()
            if measured[what].get(role) is None or measured[what][role] > limit]
    assert not over, "; ".join(over) + " (scripts/trace_save.py --per-item shows where; lower the code, not the ceiling)"
    polling = ceilings["polling"]
    over = [f"{role}: {measured['save'][role]} per item, ceiling {limit}" for role, limit in polling.items()
            if measured["save"].get(role, 0) > limit]
    assert not over, "; ".join(over)
    unknown = set(measured["save"]) - set(ceilings["save"]) - set(polling)
    assert not unknown, f"a save ran per-item work on threads with no ceiling: {sorted(unknown)}"
