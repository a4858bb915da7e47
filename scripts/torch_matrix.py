#!/usr/bin/env python3
"""Run the test suite against several torch releases: one virtual environment per release.

For each release it builds (or reuses) a venv under the cache dir (default /work/torch-matrix,
outside the repo), installs that torch first with an exact pin (the CPU build where one lies in
pip's local wheel folders, else the registry's default wheel: several GB for a CUDA build), then
this package with its test extra (``pip install -e CHECKOUT[test]``; the C++ build needs no
torch), then TorchTitan where it imports with that release, and runs ``python -m pytest -q -ra``
there (GPU tests skip on a machine without one). The results go to a dated JSON file,
benchmarks/results/<today>-torch-matrix.json (the newest earlier one is read first, so rows of
releases not run this time are kept), and to the table in docs/torch-versions.md (between the
``matrix`` markers), one row per release.

    python scripts/torch_matrix.py                       # the default releases
    python scripts/torch_matrix.py 2.14.1 --prepare-only # build the env only (background it)
    python scripts/torch_matrix.py 2.9.1 -- -k compat    # extra pytest arguments after --

Too heavy for every CI run: run it before changing the declared torch range and whenever
dcp_datastates/compat.py changes. Any release past the cap of a local pip constraint file is
installed with that constraint lifted for this command alone (PIP_CONSTRAINT is emptied).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RELEASES = ["2.9.1", "2.11.0", "2.13.0", "2.14.1", "2.15.0"]
TORCHTITAN = ["torchtitan==0.3.0", "spmd_types==0.2.3"]
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def log(msg: str) -> None:
    print(f"[torch_matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], logfile: Path, env: dict | None = None, cwd: Path | None = None, timeout: float | None = None) -> int:
    with open(logfile, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {timeout} s\n")
            return 124


_NO_CONSTRAINTS = Path("/nonexistent")


def pip_env() -> dict:
    env = dict(os.environ)
    # A machine-wide pip constraint (a cap like torch<=X) must not hide the release asked for: an
    # empty constraints file replaces it for these commands (an empty variable would not).
    env["PIP_CONSTRAINT"] = str(_NO_CONSTRAINTS)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def venv_torch(py: Path) -> dict | None:
    """What torch the venv holds: version, CUDA build or not, Python version; None if none."""
    if not py.exists():
        return None
    code = (
        "import json, sys, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'python': '.'.join(map(str, sys.version_info[:3]))}))"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=pip_env())
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_release(installed: str, wanted: str) -> bool:
    return installed.split("+")[0] == wanted.split("+")[0]


def ensure_torch(release: str, cache: Path, python: str) -> tuple[Path, dict]:
    """The venv of this release with that torch installed (reused when it already is)."""
    venv = cache / f"torch-{release}"
    py = venv / "bin" / "python"
    logfile = cache / f"torch-{release}.prepare.log"
    info = venv_torch(py)
    if info is not None and same_release(info["torch"], release):
        log(f"{release}: reusing {venv} (torch {info['torch']})")
        return venv, info
    if not py.exists():
        log(f"{release}: creating {venv}")
        if run([python, "-m", "venv", str(venv)], logfile) != 0:
            raise RuntimeError(f"{release}: could not create the venv (see {logfile})")
    log(f"{release}: installing torch=={release} (log: {logfile})")
    rc = run([str(py), "-m", "pip", "install", "--progress-bar", "off", f"torch=={release}"], logfile, env=pip_env())
    info = venv_torch(py)
    if rc != 0 or info is None or not same_release(info["torch"], release):
        raise RuntimeError(f"{release}: pip install torch=={release} failed (rc {rc}, see {logfile})")
    return venv, info


def install_package(release: str, venv: Path, cache: Path, checkout: Path) -> bool:
    """This package with its test extra, then TorchTitan if it imports with this release.
    Returns whether TorchTitan is usable there."""
    py = str(venv / "bin" / "python")
    logfile = cache / f"torch-{release}.prepare.log"
    env = pip_env()
    # The installed torch satisfies the package's requirement; the constraint keeps pip from
    # replacing it whatever the declared range says.
    pin = cache / f"torch-{release}.pin.txt"
    pin.write_text(f"torch=={venv_torch(venv / 'bin' / 'python')['torch'].split('+')[0]}\n")
    env["PIP_CONSTRAINT"] = str(pin)
    if run([py, "-m", "pip", "install", "--progress-bar", "off", "-e", f"{checkout}[test]"], logfile, env=env, cwd=checkout) != 0:
        raise RuntimeError(f"{release}: pip install -e {checkout}[test] failed (see {logfile})")
    run([py, "-m", "pip", "install", "--progress-bar", "off", "--no-deps", *TORCHTITAN], logfile, env=env)
    probe = "import torchtitan.components.checkpointer, torchtitan.components.optimizer"
    ok = subprocess.run([py, "-c", probe], capture_output=True, text=True, env=env)
    if ok.returncode != 0:
        # Leave it out, so the TorchTitan tests skip instead of failing on an import error.
        tail = (ok.stderr.strip().splitlines() or ["?"])[-1]
        log(f"{release}: TorchTitan does not import ({tail}); uninstalling it, its tests skip")
        run([py, "-m", "pip", "uninstall", "-y", "torchtitan", "spmd_types"], logfile, env=env)
        return False
    return True


def run_suite(release: str, venv: Path, cache: Path, checkout: Path, extra: list[str], timeout: float) -> dict:
    junit = cache / f"torch-{release}.junit.xml"
    logfile = cache / f"torch-{release}.pytest.log"
    logfile.write_text("")
    if junit.exists():
        junit.unlink()
    env = pip_env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # torchrun etc. of this venv
    env["VIRTUAL_ENV"] = str(venv)
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra]
    log(f"{release}: running the suite (log: {logfile})")
    start = time.monotonic()
    rc = run(cmd, logfile, env=env, cwd=checkout, timeout=timeout)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failing: list[str] = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            tid = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds or "error" in kinds:
                counts["failed" if "failure" in kinds else "errors"] += 1
                failing.append(tid)
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return {"rc": rc, "seconds": round(time.monotonic() - start), **counts, "failing": failing}


def source_commit(checkout: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if out.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "-uno"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    return None


def short_failures(failing: list[str], per_module: int = 3) -> str:
    """Failing test ids for the table: by name, or a count for a module with many (the JSON
    results keep every id)."""
    if not failing:
        return "-"
    by_module: dict[str, list[str]] = {}
    for tid in failing:
        module, _, name = tid.partition("::")
        by_module.setdefault(module.rsplit(".", 1)[-1], []).append(name)
    parts = []
    for module, names in by_module.items():
        if len(names) > per_module:
            parts.append(f"`{module}`: {len(names)} tests")
        else:
            parts.extend(f"`{module}::{n.replace('|', '/')}`" for n in names)
    return ", ".join(parts)


RESULTS = REPO / "benchmarks" / "results"


def results_paths(given: Path | None) -> tuple[Path | None, Path]:
    """(the results file to read, the one to write): ``--results`` for both, else the newest
    ``benchmarks/results/*-torch-matrix.json`` and today's (UTC) file beside it."""
    if given is not None:
        return given, given
    earlier = sorted(RESULTS.glob("*-torch-matrix.json"))
    today = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return (earlier[-1] if earlier else None), RESULTS / f"{today}-torch-matrix.json"


def render(results: dict) -> str:
    def key(rel: str):
        return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", rel))

    lines = [
        BEGIN,
        "| date (UTC) | torch | build | python | commit | TorchTitan | passed | failed | errors | skipped | failing tests |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rel in sorted(results, key=key):
        r = results[rel]
        build = "CPU" if not r.get("cuda") else f"CUDA {r['cuda']}"
        if r.get("error"):
            lines.append(f"| {r['date']} | {rel} | {build} | {r.get('python', '?')} | - | - | - | - | - | - | not run: {r['error']} |")
            continue
        lines.append(
            f"| {r['date']} | {r.get('torch', rel)} | {build} | {r['python']} | {r.get('commit') or '-'} | "
            f"{'yes' if r.get('torchtitan') else 'no'} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | "
            f"{short_failures(r['failing'])} |"
        )
    lines.append(END)
    return "\n".join(lines)


def write_doc(doc: Path, table: str) -> None:
    text = doc.read_text() if doc.exists() else "# Torch versions\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + table + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="*", default=DEFAULT_RELEASES, help=f"torch releases (default: {' '.join(DEFAULT_RELEASES)})")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TORCH_MATRIX_DIR", "/work/torch-matrix")))
    ap.add_argument("--checkout", type=Path, default=REPO, help="the source tree to install and test (default: this one)")
    ap.add_argument("--python", default="python3.11", help="interpreter the venvs are made from (default: python3.11)")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "torch-versions.md")
    ap.add_argument("--results", type=Path, default=None,
                    help="per-release results (JSON), read and written (default: the newest "
                         "benchmarks/results/*-torch-matrix.json read, benchmarks/results/<today>-torch-matrix.json written)")
    ap.add_argument("--commit", help="the source commit tested, for the table (default: the checkout's HEAD, if a git tree)")
    ap.add_argument("--prepare-only", action="store_true", help="build the environments, run nothing")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for one release's suite")
    args = ap.parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    global _NO_CONSTRAINTS
    _NO_CONSTRAINTS = args.cache_dir / "no-constraints.txt"
    _NO_CONSTRAINTS.write_text("")
    checkout = args.checkout.resolve()

    previous, args.results = results_paths(args.results)
    results = json.loads(previous.read_text()) if previous is not None and previous.exists() else {}
    status = 0
    for rel in args.releases:
        today = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        try:
            venv, info = ensure_torch(rel, args.cache_dir, args.python)
            if args.prepare_only:
                continue
            titan = install_package(rel, venv, args.cache_dir, checkout)
        except RuntimeError as exc:
            log(str(exc))
            status = 1
            if not args.prepare_only:
                results[rel] = {"date": today, "error": str(exc)}
            continue
        res = run_suite(rel, venv, args.cache_dir, checkout, extra, args.timeout)
        results[rel] = {"date": today, **info, "torchtitan": titan, "commit": args.commit or source_commit(checkout), **res}
        log(f"{rel}: {res['passed']} passed, {res['failed']} failed, {res['errors']} errors, {res['skipped']} skipped ({res['seconds']} s)")
        for t in res["failing"]:
            log(f"{rel}:   FAILED {t}")
        if res["failed"] or res["errors"] or res["rc"] not in (0, 5):
            status = 1
        args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        write_doc(args.doc, render(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
