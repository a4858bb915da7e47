"""The README's main job runs these examples; keep them working (small settings)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_demo_prints_stalls_and_reloads_bitwise(tmp_path):
    out = run([os.path.join(ROOT, "examples", "demo.py"), "--steps", "3", "--width", "64", "--layers", "2",
               "--batch", "32", "--out", str(tmp_path / "ck")], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training stall per checkpoint" in out.stdout
    assert "parameters bitwise equal: True" in out.stdout


def test_fsdp2_demo_kill_and_resume_same_losses(tmp_path):
    out = run([os.path.join(ROOT, "examples", "fsdp2_demo.py"), "--steps", "9", "--ckpt-every", "3",
               "--kill-at-step", "7", "--out", str(tmp_path / "ck")], tmp_path)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "resumed from" in out.stdout and "step-6 at step 6" in out.stdout
    assert "resumed run matches the uninterrupted one: True" in out.stdout
