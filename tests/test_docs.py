"""Every command and snippet in README.md and docs/ runs here, so the docs cannot drift from the code.

Each document's code blocks run in order in a fresh folder (with ``examples/``, ``benchmarks/`` and ``docs/`` linked in): a
``python`` block is a script of its own (one process each, so a resume recipe really runs in a
new process; a block starting with ``# name.py`` is written to that file for a later ``bash``
block to run), a ``bash`` block runs in bash with this interpreter's ``bin`` first on PATH.
Blocks without a language are program output or diagrams, unless their first line is a command.

A block that cannot run here says where it runs instead, and this file checks that the same
commands are there: ``<!-- ci: ... -->`` before a block (the README's install commands, run by
.ci/run), or ``ELSEWHERE`` (a test file running the same command), or ``ARGS_ONLY`` (the long
benchmark runs: their arguments are checked against the command's ``--help``).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
COMMAND_WORDS = ("python", "python3", "pip", "torchrun", "dcp-datastates")
RUN_TIMEOUT = 300


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    text: str
    marker: str  # the HTML comment right before the fence, or ""

    @property
    def first(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    def is_command(self) -> bool:
        if self.lang in ("python", "bash", "sh", "console"):
            return True
        return self.lang == "" and self.first.split(" ")[0] in COMMAND_WORDS


def blocks(doc: str) -> list[Block]:
    out, lines = [], (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        marker = lines[i - 1].strip() if i > 0 and lines[i - 1].strip().startswith("<!--") else ""
        out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1 : j]) + "\n", marker))
        i = j + 1
    return out


def commands_of(text: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments dropped, split on &&."""
    joined = re.sub(r"\\\n\s*", " ", text)
    cmds = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            cmds += [c.strip() for c in line.split("&&") if c.strip()]
    return cmds


def normalized(cmd: str) -> str:
    return " ".join(w for w in cmd.split() if w != "-q")


# ----------------------------------------------------------- blocks that run somewhere else
# (doc, a line of the block) -> (test file, texts that test must contain: the same command)
ELSEWHERE = {
    ("docs/integrations.md", "torchrun --nproc_per_node 8 -m torchtitan.train"): (
        "tests/test_torchtitan.py", ["--checkpoint.host_cache_size", "--checkpoint.flush_threads", "ConfigManager()"]),
    ("docs/integrations.md", "from torchtitan.models.llama3.config_registry import llama3_8b"): (
        # llama3's registry imports triton, absent on CPU machines; the same from_base call runs there
        "tests/test_torchtitan.py", ["Config.from_base(base, host_cache_size="]),
    ("docs/configuration.md", "import torch.distributed as dist, torch.distributed.checkpoint as dcp"): (
        # needs an initialized process group of several ranks: the same calls run there
        "tests/test_node_stops.py", ["checkpoint_process_group(stall_timeout=STALL)",
                                     "storage_writer=writer, process_group=group"]),
    ("docs/integrations.md", "scripts/torchtitan_main.sh"): (
        # needs GitHub (or a TorchTitan clone); the test reruns the file against the snapshot it makes
        "tests/test_torchtitan.py", ["scripts/torchtitan_main.sh", "DCPDS_TORCHTITAN_MAIN",
                                     "def test_torchtitan_main_at_the_pinned_commit"]),
}
# Long benchmark runs: each --flag must be one the command accepts.
ARGS_ONLY = ("python -m dcp_datastates bench --dir", "python -m dcp_datastates bench --loop", "python benchmarks/bench_remote.py", "python benchmarks/bench_planning.py",
             "python benchmarks/bench_tiers.py", "python benchmarks/save_load_ab.py", "python benchmarks/bench_incremental.py",
             "python benchmarks/bench_peers.py", "python benchmarks/end_to_end.py",
             "python3 scripts/torch_matrix.py",  # hours of downloads and runs: arguments checked only
             "python -m dcp_datastates bench --device cuda",  # needs a GPU: arguments checked only
             "python -m dcp_datastates bench --size", "python scripts/commit_time.py",
             "python scripts/scale_table.py", "python scripts/direct_write_time.py",
             "python benchmarks/load_profile.py", "python benchmarks/overwrite_folder.py",
             "python benchmarks/fork_children.py", "python scripts/staged_vs_durable.py")  # minutes each: arguments checked

# Code a block needs from the surrounding text (a model, a saved checkpoint), run before it.
_SAVED = """
import os, torch, torch.distributed.checkpoint as dcp, warnings
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
from dcp_datastates import DataStatesWriter
def _save_ckpt(path):
    if not os.path.exists(os.path.join(path, ".metadata")):
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 3}, storage_writer=DataStatesWriter(path))
"""
PRELUDES = {
    ("docs/integrations.md", "resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, process_gr"): _SAVED + """
model = torch.nn.Linear(8, 8); optimizer = torch.optim.AdamW(model.parameters())
state = {"model": model.state_dict(), "step": 1}; path = "ckpt/plain"; ckpt_group = None
""",
    ("docs/integrations.md", "model_sd, optim_sd = get_state_dict(model, optimizer)"): """
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter
model = torch.nn.Linear(8, 8); optimizer = torch.optim.AdamW(model.parameters()); step = 1; ckpt_group = None
""",
    ("docs/integrations.md", 'opts = {"endpoint_url"'): """
import torch, torch.distributed.checkpoint as dcp, dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter
state = {"w": torch.arange(4.0)}
""",
    ("docs/integrations.md", 'DataStatesConfig.from_file("deepspeed_config.json")'): f"""
import shutil
for name in ("deepspeed_config.json", "nanotron.yaml"):
    shutil.copy({str(ROOT / "examples" / "configs")!r} + "/" + name, name)
""",
    ("docs/troubleshooting.md", "except CheckpointException as exc:"): _SAVED + """
from dcp_datastates import DataStatesReader
path = "ckpt/broken"; _save_ckpt(path); os.unlink(os.path.join(path, ".metadata"))
state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
""",
    ("docs/troubleshooting.md", "cause = checkpoint_error_cause(exc, reader)"): _SAVED + """
from dcp_datastates import DataStatesReader, IncompleteCheckpointError, checkpoint_error_cause
path = "ckpt/broken"; _save_ckpt(path); os.unlink(os.path.join(path, ".metadata"))
state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
""",
    ("docs/troubleshooting.md", "dcp-datastates verify ckpt/step-300"): _SAVED + '_save_ckpt("ckpt/step-300")\n',
    ("docs/file-format.md", 'safe_open("ckpt/step-100/__0_0.safetensors"'): _SAVED + '_save_ckpt("ckpt/step-100")\n',
    ("docs/migrating.md", "dcp-datastates convert ckpt/step-100 dcp-out --to dcp"): _SAVED + '_save_ckpt("ckpt/step-100")\n',
    # a checkpoint holding values outside PyTorch's restricted unpickler, loaded after opting in
    ("docs/security.md", "torch.serialization.add_safe_globals([MyTrainState])"): _SAVED + """
import dataclasses, decimal
from dcp_datastates import DataStatesReader
@dataclasses.dataclass
class MyTrainState:
    step: int = 0
path = "ckpt/values"
dcp.save({"ts": MyTrainState(5), "loss_scale": decimal.Decimal("0.5")}, storage_writer=DataStatesWriter(path))
state = {"ts": None, "loss_scale": None}
""",
    ("docs/security.md", "DataStatesReader(path, trusted=True)"): _SAVED + """
from dcp_datastates import DataStatesReader
path = "ckpt/plain"; _save_ckpt(path)
state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
""",
}
# Text swapped in before running (a local stand-in for a remote store).
SUBSTITUTIONS = {
    ("docs/integrations.md", 'opts = {"endpoint_url"'): [
        ('opts = {"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "..."}', "opts = {}"),
        ("s3://", "memory://"),
    ],
}
# Checks appended to a block: the quick start's resume recipe restores everything, by value.
EPILOGUES = {
    ("docs/quickstart.md", "# train.py"): """
torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": data.get_state()}, "expected.pt")
""",
    ("docs/quickstart.md", "# resume.py"): """
expected = torch.load("expected.pt")
for k, v in expected["model"].items():
    assert torch.equal(model.state_dict()[k], v), k
got = optimizer.state_dict()["state"]
assert len(got) == len(expected["optim"]["state"]) == 4, len(got)
for i, st in expected["optim"]["state"].items():
    assert set(got[i]) == {"step", "exp_avg", "exp_avg_sq"}, got[i].keys()
    for k, v in st.items():
        assert torch.equal(got[i][k], v), (i, k)
assert float(got[0]["step"]) == 6.0
assert torch.equal(data.get_state(), expected["rng"]) and start == 7
print("RESUME-CHECKED")
""",
}


def _keyed(table: dict, b: Block):
    return [v for (doc, needle), v in table.items() if doc == b.doc and needle in b.text]


def _where(b: Block) -> str:
    if b.marker.startswith("<!-- ci"):
        return "ci"
    if _keyed(ELSEWHERE, b):
        return "elsewhere"
    if any(b.first.startswith(a) for a in ARGS_ONLY):
        return "args"
    return "run"


ALL = [b for d in DOCS for b in blocks(d) if b.is_command()]


def test_the_docs_have_commands_and_each_is_accounted_for():
    assert len(ALL) >= 20
    unclaimed = [k for k in list(PRELUDES) + list(EPILOGUES) + list(SUBSTITUTIONS) + list(ELSEWHERE)
                 if not any(b.doc == k[0] and k[1] in b.text for b in ALL)]
    assert not unclaimed, f"stale entries (the doc changed): {unclaimed}"


def test_ci_blocks_are_what_ci_runs():
    ci = normalized((ROOT / ".ci" / "run").read_text())
    marked = [b for b in ALL if _where(b) == "ci"]
    assert any(b.doc == "README.md" for b in marked) and any(b.doc == "docs/quickstart.md" for b in marked)
    for b in marked:
        for cmd in commands_of(b.text):
            assert normalized(cmd) in ci, f"{b.doc}:{b.line}: {cmd!r} is not in .ci/run"


@pytest.mark.parametrize("key", list(ELSEWHERE), ids=lambda k: k[1][:40])
def test_blocks_run_elsewhere_are_there(key):
    test_file, needles = ELSEWHERE[key]
    text = (ROOT / test_file).read_text()
    for needle in needles:
        assert needle in text, f"{test_file} no longer runs {needle!r} ({key[0]})"


def test_benchmark_commands_take_their_arguments():
    commands = []  # (block, words, the script's command line without --help)
    for b in ALL:
        if _where(b) != "args":
            continue
        for cmd in commands_of(b.text):
            words = shlex.split(cmd)
            script = words[: words.index("bench") + 1] if "bench" in words else words[:2]
            # `dcp-datastates bench` hands its arguments to benchmarks/bench.py of a checkout (an
            # installed wheel has none); run from ROOT, a `-m` would import the checkout's package
            run = ("benchmarks/bench.py",) if script[1:4] == ["-m", "dcp_datastates", "bench"] else tuple(script[1:])
            commands.append((b, words, run))
    # Each script's --help once (a process each, most of it importing torch), two at a time.
    scripts = sorted({run for _, _, run in commands})
    helptexts = {}
    for i in range(0, len(scripts), 2):
        procs = {run: subprocess.Popen([sys.executable, *run, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for run in scripts[i:i + 2]}
        for run, proc in procs.items():
            helptexts[run], err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{' '.join(run)} --help exited with {proc.returncode}:\n{err[-2000:]}"
    for b, words, run in commands:
        for flag in (w for w in words if w.startswith("--")):
            assert flag in helptexts[run], f"{b.doc}:{b.line}: {flag} is not an option of {' '.join(run)}"
    assert len(commands) >= 3


@functools.cache
def _torchtitan_imports() -> bool:
    try:
        import torchtitan  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - missing, or built against another torch
        return False
    return True


def _run_doc(doc: str, tmp: Path) -> list[str]:
    (tmp / "examples").symlink_to(ROOT / "examples")
    (tmp / "docs").symlink_to(ROOT / "docs")
    (tmp / "benchmarks").symlink_to(ROOT / "benchmarks")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    outputs, ran = [], set()
    for k, b in enumerate(x for x in ALL if x.doc == doc and _where(x) == "run"):
        text = b.text
        if b.lang != "python" and not _keyed(PRELUDES, b) and text in ran:
            continue  # the same command shown again further down (benchmarks.md): it ran above
        ran.add(text)
        if "torchtitan" in text and not _torchtitan_imports():
            continue  # e.g. torch 2.9, where TorchTitan 0.3.0 does not import (docs/torch-versions.md)
        for old, new in (sum(_keyed(SUBSTITUTIONS, b), [])):
            assert old in text, f"{doc}:{b.line}: substitution {old!r} no longer applies"
            text = text.replace(old, new)
        prelude = "".join(_keyed(PRELUDES, b))
        epilogue = "".join(_keyed(EPILOGUES, b))
        if b.lang == "python":
            name = b.first[2:].strip() if re.fullmatch(r"# [\w.-]+\.py", b.first) else f"_block{k}.py"
            (tmp / name).write_text(prelude + text + epilogue)
            if not name.startswith("_block"):
                continue  # run by the bash block that follows, as the doc says
            args = [sys.executable, name]
        else:
            if prelude:
                (tmp / f"_prelude{k}.py").write_text(prelude)
                subprocess.run([sys.executable, f"_prelude{k}.py"], cwd=tmp, env=env, check=True, timeout=RUN_TIMEOUT)
            args = ["bash", "-e", "-o", "pipefail", "-c", text]
        r = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert r.returncode == 0, f"{doc}:{b.line} failed ({r.returncode}):\n{text}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-4000:]}"
        outputs.append(r.stdout)
    return outputs


RUN_DOCS = sorted({b.doc for b in ALL if _where(b) == "run"})


@pytest.mark.parametrize("doc", RUN_DOCS)
def test_doc_blocks_run_in_order(doc, tmp_path):
    outputs = _run_doc(doc, tmp_path)
    assert outputs
    if doc == "docs/quickstart.md":
        text = "".join(outputs)
        assert "RESUME-CHECKED" in text  # model, Adam moments and step, data: equal by value
        assert "resumed from ckpt/step-6; training goes on at step 7" in text
        assert "resumed from ckpt_fsdp2/step-6 at step 6" in text
        assert (tmp_path / "dcp-out" / ".metadata").exists() and (tmp_path / "state.pt").exists()


def test_config_file_blocks_in_the_docs_load(tmp_path):
    from dcp_datastates import DataStatesConfig

    loaded = 0
    for b in blocks("docs/configuration.md"):
        if b.lang in ("yaml", "json"):
            path = tmp_path / f"block{b.line}.{b.lang}"
            path.write_text(b.text)
            config = DataStatesConfig.from_file(path)
            assert config.host_cache_size == 16 << 30, b.line  # the seeds' `host_cache_size: 16`
            loaded += 1
    assert loaded == 2


# ------------------------------------------------------------ result files, links, the module map
RESULTS = ROOT / "benchmarks" / "results"
LINKED_DOCS = [*DOCS, "benchmarks/results/README.md", "benchmarks/results/history-benchmarks.md"]


def _prose(doc: str) -> str:
    """A document's text without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", (ROOT / doc).read_text(), flags=re.M | re.S)


def test_docs_hold_no_result_files():
    """docs/ holds documents only; results go to benchmarks/results/ (docs/benchmarks.md quotes them)."""
    others = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").iterdir() if p.suffix != ".md")
    assert not others, f"result files (or folders) in docs/, move them to benchmarks/results/: {others}"


def test_relative_links_and_named_result_files_exist():
    """Every relative link of the docs and the results' index reaches a file, and every
    ``benchmarks/results/<file>`` a document names exists."""
    broken = []
    for doc in LINKED_DOCS:
        text = _prose(doc)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not ((ROOT / doc).parent / target.split("#")[0]).exists():
                broken.append(f"{doc}: link to {target}")
        if doc in DOCS:  # the index and the history quote commands, whose outputs may not be kept
            for name in re.findall(r"benchmarks/results/[\w.-]+\.(?:json|png|md)\b", (ROOT / doc).read_text()):
                if not (ROOT / name).exists():
                    broken.append(f"{doc}: names {name}")
    assert not broken, "\n".join(broken)


def test_the_results_index_lists_every_result_file():
    """benchmarks/results/README.md has one row per result file, and no row for a file that is gone."""
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^\| \[([^\]]+)\]\(\1\) \|", index, flags=re.M))
    files = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()} - {"README.md", "history-benchmarks.md"}
    assert files - listed == set(), f"result files without a row in benchmarks/results/README.md: {sorted(files - listed)}"
    assert listed - files == set(), f"rows of benchmarks/results/README.md naming no file: {sorted(listed - files)}"
    assert "(history-benchmarks.md)" in index


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module and package of dcp_datastates."""
    modules = {}
    for path in sorted((ROOT / "dcp_datastates").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def first_docstring_line(path: Path) -> str | None:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=True)
    return doc.strip().splitlines()[0].strip() if doc and doc.strip() else None


def module_map_problems(doc_text: str, modules: dict[str, Path]) -> list[str]:
    """What docs/how-it-works.md's module map (rows ``| `dcp_datastates.x` | concern |`` under
    "## Module map") gets wrong against the package: each problem names its module."""
    section = doc_text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(dcp_datastates(?:\.\w+)*)` \| (.*) \|$", section, flags=re.M)
    mapped = {name: concern.replace("\\|", "|").strip() for name, concern in rows}
    problems = [f"{name}: listed twice in the module map" for name in sorted(mapped) if [n for n, _ in rows].count(name) > 1]
    for name in sorted(modules.keys() - mapped.keys()):
        problems.append(f"{name}: in the package ({modules[name].relative_to(ROOT)}) but not in the module map; "
                        f"add the row | `{name}` | {first_docstring_line(modules[name])} |")
    for name in sorted(mapped.keys() - modules.keys()):
        problems.append(f"{name}: in the module map but not in the package (renamed, merged or removed?)")
    for name in sorted(mapped.keys() & modules.keys()):
        first = first_docstring_line(modules[name])
        if first is None:
            problems.append(f"{name}: has no docstring, whose first line names its concern")
        elif mapped[name] != first:
            problems.append(f"{name}: the module map says {mapped[name]!r}, the docstring's first line is {first!r}")
    return problems


def test_the_module_map_is_the_package():
    """docs/how-it-works.md's module map lists every module and package of dcp_datastates, and no
    other, each with the first line of its docstring as its concern."""
    problems = module_map_problems((ROOT / "docs" / "how-it-works.md").read_text(), package_modules())
    assert not problems, "docs/how-it-works.md, \"Module map\", is out of date:\n  " + "\n  ".join(problems)


def test_the_module_map_check_names_what_is_wrong():
    """The check is live: a module missing from the map, a row for no module, and a changed
    concern are each reported by name."""
    doc = (ROOT / "docs" / "how-it-works.md").read_text()
    modules = package_modules()
    concern = first_docstring_line(modules["dcp_datastates.writer"])
    row = f"| `dcp_datastates.writer` | {concern} |\n"
    assert row in doc
    changed = doc.replace(row, "| `dcp_datastates.writer` | something else |\n| `dcp_datastates.save.gone` | a module no more |\n")
    problems = module_map_problems(changed, modules)
    assert any(p.startswith("dcp_datastates.writer: the module map says 'something else'") for p in problems), problems
    assert any(p.startswith("dcp_datastates.save.gone: in the module map but not in the package") for p in problems), problems
    problems = module_map_problems(doc.replace(row, ""), modules)
    assert problems == [p for p in problems if p.startswith("dcp_datastates.writer: in the package")] and problems, problems
