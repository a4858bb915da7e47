"""The package's import graph: the layers contract (.importlinter, checked by import-linter) holds
and says what docs/how-it-works.md's module map says; no module imports itself back through
others (no circle, read from the source with ``ast``: function-level imports count too, a lazy
import is still a dependency); the DCP writer stays a thin adapter."""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dcp_datastates"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    base = PKG.parent / rel
    return base.with_suffix(".py").exists() or base.is_dir() or any(base.parent.glob(f"{base.name}.*.so"))


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = _module_name(path)
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "dcp_datastates":
                    continue
                for alias in node.names:
                    name = f"{target}.{alias.name}"
                    edges.add(name if _is_module(name) else target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == "dcp_datastates")
        edges.discard(mod)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "dcp_datastates.writer" in graph and "dcp_datastates.save" in graph["dcp_datastates.writer"]
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check can fail


def test_no_import_circle():
    assert _circles(import_graph()) == []


def _layers() -> list[list[str]]:
    config = configparser.ConfigParser()
    config.read(PKG.parent / ".importlinter")
    lines = config["importlinter:contract:layers"]["layers"].strip().splitlines()
    return [[m.strip() for m in line.split("|")] for line in lines if line.strip()]


def _lint_imports(config: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (it is in the test extra)")
    return subprocess.run([exe, "--config", str(config), "--no-cache"], cwd=PKG.parent, capture_output=True,
                          text=True, timeout=120)


def test_layers_contract_is_kept():
    """import-linter checks the contracts of .importlinter: the layers (each imports only the
    layers below it) and the pure plan (save/plan.py and save/planning.py reach no runtime,
    storage or engine)."""
    r = _lint_imports(PKG.parent / ".importlinter")
    assert r.returncode == 0 and re.search(r"Contracts: \d+ kept, 0 broken", r.stdout), r.stdout + r.stderr
    assert "the plan is pure" in r.stdout, r.stdout


def test_layers_contract_can_fail(tmp_path):
    """The same contract with two layers swapped is reported broken (the check is live)."""
    text = (PKG.parent / ".importlinter").read_text()
    swapped = text.replace("    dcp_datastates.channel\n    dcp_datastates.storage\n", "    dcp_datastates.storage\n    dcp_datastates.channel\n")
    assert swapped != text
    (tmp_path / "contract.ini").write_text(swapped)
    r = _lint_imports(tmp_path / "contract.ini")
    assert r.returncode != 0 and "dcp_datastates.channel is not allowed to import dcp_datastates.storage" in r.stdout


def test_the_storage_contract_can_fail(tmp_path):
    """The folders-only contract with the exceptions module forbidden too is reported broken (every
    storage raises the library's errors, so the check is live)."""
    text = (PKG.parent / ".importlinter").read_text()
    stricter = text.replace("source_modules =\n    dcp_datastates.storage\nforbidden_modules =\n    dcp_datastates.native\n",
                            "source_modules =\n    dcp_datastates.storage\nforbidden_modules =\n    dcp_datastates.native\n"
                            "    dcp_datastates.errors\n")
    assert stricter != text
    (tmp_path / "contract.ini").write_text(stricter)
    r = _lint_imports(tmp_path / "contract.ini")
    assert r.returncode != 0 and "dcp_datastates.storage is not allowed to import dcp_datastates.errors" in r.stdout


def test_the_plan_contract_can_fail(tmp_path):
    """The pure plan's contract with the format layer forbidden too is reported broken (the plan
    lays out files with it, so the check is live)."""
    text = (PKG.parent / ".importlinter").read_text()
    stricter = text.replace("forbidden_modules =\n    dcp_datastates.runtime\n",
                            "forbidden_modules =\n    dcp_datastates.runtime\n    dcp_datastates.format\n")
    assert stricter != text
    (tmp_path / "contract.ini").write_text(stricter)
    r = _lint_imports(tmp_path / "contract.ini")
    assert r.returncode != 0 and "dcp_datastates.save.plan is not allowed to import dcp_datastates.format" in r.stdout


def test_docs_module_map_names_the_contract_layers():
    """docs/how-it-works.md's module map lists the layers in the contract's order."""
    doc = (PKG.parent / "docs" / "how-it-works.md").read_text()
    section = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *(\d+) *\| *([^|]+)\|", section, flags=re.M)
    documented = [sorted(m.strip(" `") for m in names.split(",")) for _, names in rows]
    expected = [sorted(m.removeprefix("dcp_datastates.") for m in layer) for layer in _layers()]
    assert documented == expected


def test_the_writer_is_a_thin_adapter():
    """writer.py answers DCP and delegates each callback to a step of the save: at most ~400
    lines and 8 in-package imports."""
    graph = import_graph()
    source = (PKG / "writer.py").read_text()
    assert len(source.splitlines()) <= 400
    assert len(graph["dcp_datastates.writer"]) <= 8, sorted(graph["dcp_datastates.writer"])


def test_the_save_and_load_tracer_runs(tmp_path):
    """scripts/trace_save.py: the figures issue 25 tracks (modules a save and a load enter)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trace_save", PKG.parent / "scripts" / "trace_save.py")
    trace_save = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace_save)
    report = trace_save.main(["--tensors", "16", "--json", str(tmp_path / "t.json")])
    main = report["save"]["MainThread"]
    assert main["order"][0] == "writer" and main["modules"] >= 2 and main["entries"] >= main["modules"]
    assert report["load"]["MainThread"]["order"][0] == "reader"
    assert (tmp_path / "t.json").exists()


def test_local_or_remote_is_decided_in_the_storage_layer_only():
    """No module outside ``storage`` and ``channel`` (one data channel per kind of storage) asks
    whether a location is a URL or which storage it holds; the few that open a ``LocalStorage``
    directly say why on that line (the local tier and ``verify`` read folders of this machine by
    definition)."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(("storage/", "channel/")):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "is_remote(" in code or "ObjectStorage" in code:
                offenders.append(f"{rel}:{n}: {line.strip()}")
            if ("LocalStorage(" in code or '"://" in' in code) and "#" not in line:
                offenders.append(f"{rel}:{n}: {line.strip()} (no comment saying why)")
    assert offenders == [], "\n".join(offenders)
