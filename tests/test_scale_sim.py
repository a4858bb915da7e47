"""benchmarks/bench_scale_sim.py (issue 48) runs: a small case of every layout, both methods,
with the figures the docs quote, and the packed metadata on the datastates side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_scale_simulator_runs_every_layout_beside_stock_dcp(tmp_path):
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale_sim.py"), "--layouts", "fsdp", "hsdp",
                        "fsdp_tp", "--models", "tiny", "--ranks", "8", "--repeat", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, DCP_DATASTATES_PACK_FROM_CHUNKS="1"))  # the packed table at this size
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert {(c["layout"], c["method"]) for c in cases} == {(lay, m) for lay in ("fsdp", "hsdp", "fsdp_tp")
                                                            for m in ("datastates", "dcp")}
    for c in cases:
        assert not c.get("skipped") and not c.get("error"), c
        assert c["chunks"] > 0 and c["metadata_bytes"] > 0 and c["dtensor_matches_sim"] is True, c
        for figure in ("commit_total_s", "md_read_s", "load_plan_default_s", "global_plan_first_s"):
            assert c[figure] >= 0, (figure, c)
        if c["method"] == "datastates":
            assert c["load_plan_ours_s"] >= 0 and c["steady_plan_unusable"] is True, c
