"""ruff, configured in pyproject.toml ([tool.ruff]), is clean on the whole tree. It is in the
test extra, so the README's test command (and .ci/run) runs it. And no comment or docstring of
the package or the engine quotes a duration measured on one machine (issue 50): those belong in
docs/benchmarks.md and benchmarks/results/, where the machine, date and command go with them."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}\n{out.stderr}"


# --------------------------------------------------------------------------- machine timings
# What a measured duration looks like in prose: a number of milli/micro/nanoseconds, a rate in
# bytes per second or seconds per GiB, "~N s", or a number of seconds beside a word that names
# where or how it was measured. A configured duration ("the default, 300 s", "every 0.1 s") is
# none of these.
_NUM = r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s?(?:-|to|against)\s?\d+(?:[.,]\d+)?)?"
_TIMING = re.compile(
    rf"{_NUM}\s?(?:ms|us|µs|ns|(?:milli|micro|nano)seconds?)\b"
    rf"|{_NUM}\s?(?:[KMGT]i?B)/s\b"
    rf"|{_NUM}\s?s(?:ec(?:ond)?s?)?\s(?:a|per)\s(?:[KMGT]i?B)\b"
    rf"|~\s?{_NUM}\s?s(?:ec(?:ond)?s?)?\b")
_SECONDS = re.compile(rf"{_NUM}\s?s(?:ec(?:ond)?s?)?\b")
_WHERE_MEASURED = re.compile(
    r"\b(?:here|took|measured|on this (?:machine|VM)|(?:bench|this project's) machine|VM"
    r"|[AHB]\d00|in the benchmark)\b", re.IGNORECASE)
_NEAR = 60  # characters either side of a number of seconds searched for such a word


def timing_quotes(text: str) -> list[tuple[int, str]]:
    """(offset, the quoted figure) of every measured duration ``text`` quotes."""
    found = list(_TIMING.finditer(text))
    for m in _SECONDS.finditer(text):
        near = text[max(0, m.start() - _NEAR):m.end() + _NEAR]
        if _WHERE_MEASURED.search(near) and all(m.end() <= f.start() or f.end() <= m.start() for f in found):
            found.append(m)
    return sorted((m.start(), m.group()) for m in found)


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each run of comment lines and each string statement (docstrings)."""
    source = path.read_text(encoding="utf-8")
    blocks: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            if line == last + 1 and blocks:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + tok.string)
            else:
                blocks.append((line, tok.string))
            last = line
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            blocks.append((node.value.lineno, node.value.value))
    return blocks


_CXX_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')


def _cxx_prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each run of ``//`` comment lines."""
    blocks: list[tuple[int, str]] = []
    last = -2
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        at = _CXX_LITERAL.sub(lambda m: " " * len(m.group()), text).find("//")
        if at < 0:
            continue
        if line == last + 1 and blocks:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text[at:])
        else:
            blocks.append((line, text[at:]))
        last = line
    return blocks


def _timings_in(files, prose) -> list[str]:
    problems = []
    for path in files:
        for first, text in prose(path):
            for at, figure in timing_quotes(text):
                line = first + text.count("\n", 0, at)
                problems.append(f"{path.relative_to(ROOT)}:{line}: {figure!r} in "
                                f"{text.splitlines()[text.count(chr(10), 0, at)].strip()!r}")
    return problems


def test_no_machine_timings_in_comments():
    """A comment or docstring says why (pinning is slow next to the read), not how long it took on
    one machine: such a figure goes stale and has no machine, date or command beside it."""
    problems = _timings_in(sorted((ROOT / "dcp_datastates").rglob("*.py")), _python_prose)
    problems += _timings_in(sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".hpp")),
                            _cxx_prose)
    assert not problems, ("comments or docstrings quote a measured duration (say why in words; the figures "
                          "belong in docs/benchmarks.md or benchmarks/results/):\n" + "\n".join(problems))


def test_timing_check_flags_measurements_only(tmp_path):
    measured = [
        "75 ms for 1,612 items here",
        "~0.3 s of a 0.5 s first load of 512 MiB on an H200",
        "0.5 us, against 2-4 us for a frozen dataclass",
        "1 GiB took 1.5 s on this project's ext4 VM",
        "the call 11-15 ms of wall for 6 ms of CPU",
        "~40 ms per 256 MiB on tmpfs here",
        "decoding a large marker holds the GIL (~0.4 s at 20,000 items)",
        "tmpfs: 0.19 against 0.37 s a GiB",
        "writes at 2.5 GB/s",
        "every microsecond per item is 20 milliseconds of time to durable",
    ]
    for text in measured:
        assert timing_quotes(text), text
    configured = [
        "choose stall_timeout above the longest time one rank may take (the default, 300 s, is far above)",
        "the sliced waits below take the GIL back every 0.1 s",
        "Bytes per second from the save call to durable, in GB/s (10^9)",
        "a fresh one costs a page fault per 4 KiB page; 20,000 items must take about a millisecond",
        "gloo's default 30 minutes; 2 x CPUs; 4 KiB pages; 3 saves here",
    ]
    for text in configured:
        assert not timing_quotes(text), (text, timing_quotes(text))
    # and the scan of files finds them, naming file and line: in a comment, a docstring, C++
    py = tmp_path / "m.py"
    py.write_text('"""Module."""\n\nx = 1  # took 1.5 s here\n\n\ndef f():\n    """Fast.\n\n    0.5 us each."""\n')
    cc = tmp_path / "m.cpp"
    cc.write_text('const char* u = "http://x 5 ms";  // fine\n// two files: 0.19 against 0.37 s a GiB\n')
    assert [(line, figure) for line, figure in _lines(py, _python_prose)] == [(3, "1.5 s"), (9, "0.5 us")]
    assert [(line, figure) for line, figure in _lines(cc, _cxx_prose)] == [(2, "0.19 against 0.37 s a GiB")]


def _lines(path: Path, prose) -> list[tuple[int, str]]:
    return sorted((first + text.count("\n", 0, at), figure)
                  for first, text in prose(path) for at, figure in timing_quotes(text))
