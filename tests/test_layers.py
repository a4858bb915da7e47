"""The package's import graph: no module imports itself back through others (no circle), and the
commit protocol and the checkpoint format know nothing of the tiers. Read from the source with
``ast`` (function-level imports count too: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    assert "dcp_datastates.writer" in graph and "dcp_datastates.commit" in graph["dcp_datastates.writer"]
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check can fail


def test_no_import_circle():
    assert _circles(import_graph()) == []


def test_commit_and_format_know_nothing_of_tiers():
    graph = import_graph()
    for low in ("dcp_datastates.commit", "dcp_datastates.checkpoint_format", "dcp_datastates.integrity"):
        assert not graph[low] & {"dcp_datastates.tiers", "dcp_datastates.drain"}, low


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
