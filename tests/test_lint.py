"""ruff, configured in pyproject.toml ([tool.ruff]), is clean on the whole tree. It is in the
test extra, so the README's test command (and .ci/run) runs it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}\n{out.stderr}"
