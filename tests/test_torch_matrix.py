"""scripts/torch_matrix.py's bookkeeping (the environments themselves are too heavy for a test):
the results table, its merge into docs/torch-versions.md, and which installed build counts as the
release asked for."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torch_matrix.py"
spec = importlib.util.spec_from_file_location("torch_matrix", SCRIPT)
tm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tm)


def test_same_release_ignores_the_local_build_label_only():
    assert tm.same_release("2.13.0+cpu", "2.13.0") and tm.same_release("2.14.1+cu130", "2.14.1")
    assert not tm.same_release("2.14.0+cu130", "2.14.1") and not tm.same_release("2.1.0", "2.10.0")


def test_table_rows_sorted_by_release_with_failures_grouped():
    results = {
        "2.10.0": {"date": "d", "torch": "2.10.0+cu128", "cuda": "12.8", "python": "3.11.7", "torchtitan": False,
                   "passed": 5, "failed": 5, "errors": 0, "skipped": 1,
                   "failing": [f"tests.test_bad_input::t{i}" for i in range(4)] + ["tests.test_gpu::x[a|b]"]},
        "2.9.1": {"date": "d", "error": "pip install torch==2.9.1 failed"},
        "2.13.0": {"date": "d", "torch": "2.13.0+cpu", "cuda": None, "python": "3.11.7", "torchtitan": True,
                   "commit": "abc1234", "passed": 9, "failed": 0, "errors": 0, "skipped": 0, "failing": []},
    }  # fmt: skip
    lines = tm.render(results).splitlines()
    assert lines[0] == tm.BEGIN and lines[-1] == tm.END
    rows = lines[3:-1]
    assert [r.split(" | ")[1] for r in rows] == ["2.9.1", "2.10.0+cu128", "2.13.0+cpu"]  # numeric order
    assert "not run: pip install torch==2.9.1 failed" in rows[0]
    assert "| CUDA 12.8 |" in rows[1] and "`test_bad_input`: 4 tests" in rows[1] and "`test_gpu::x[a/b]`" in rows[1]
    assert "| CPU |" in rows[2] and "| abc1234 | yes | 9 | 0 | 0 | 0 | - |" in rows[2]
    assert all(r.count("|") == lines[1].count("|") for r in rows), "a row has the wrong number of columns"


def test_doc_keeps_its_prose_and_replaces_only_the_table(tmp_path):
    doc = tmp_path / "torch-versions.md"
    doc.write_text(f"# Title\n\nbefore\n\n{tm.BEGIN}\nold table\n{tm.END}\n\nafter\n")
    tm.write_doc(doc, f"{tm.BEGIN}\nnew table\n{tm.END}")
    assert doc.read_text() == f"# Title\n\nbefore\n\n{tm.BEGIN}\nnew table\n{tm.END}\n\nafter\n"
    fresh = tmp_path / "new.md"
    tm.write_doc(fresh, f"{tm.BEGIN}\nt\n{tm.END}")
    assert fresh.read_text().endswith(f"{tm.BEGIN}\nt\n{tm.END}\n")


def test_results_are_read_from_the_newest_dated_file_and_written_to_todays(tmp_path, monkeypatch):
    """Without --results the newest benchmarks/results/*-torch-matrix.json is read (rows of releases
    not run again are kept) and today's dated file written; --results names one file for both."""
    monkeypatch.setattr(tm, "RESULTS", tmp_path)
    assert tm.results_paths(None)[0] is None
    for date in ("2026-11-23", "2026-11-24"):
        (tmp_path / f"{date}-torch-matrix.json").write_text("{}")
    read, write = tm.results_paths(None)
    assert read == tmp_path / "2026-11-24-torch-matrix.json"
    assert write.parent == tmp_path and write.name.endswith("-torch-matrix.json") and len(write.name) == len("2026-11-24-torch-matrix.json")
    given = tmp_path / "mine.json"
    assert tm.results_paths(given) == (given, given)
    assert sorted((tm.REPO / "benchmarks" / "results").glob("*-torch-matrix.json")), "the committed results moved"
