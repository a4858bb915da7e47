"""The ``dcp-datastates`` command line (also ``python -m dcp_datastates``).

    dcp-datastates inspect PATH [--json] [--chunks]
    dcp-datastates verify PATH
    dcp-datastates convert PATH OUT --to hf|torch|dcp [--max-shard-size 5GB] [--prefix model.]
                                   [--hf-config CONFIG.json|MODEL_FOLDER]
    dcp-datastates bench ...

Exit status: 0 on success; 1 with a one-line message on a checkpoint, file or argument error
(``verify`` also returns 1 when the checkpoint is damaged, after naming every problem); 2 for a
usage error or a subcommand that is not available.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import warnings
from typing import Any

__all__ = ["main"]

PROG = "dcp-datastates"



# ------------------------------------------------------------------------------------ helpers
def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def _one_line(text: str) -> str:
    return " ".join(str(text).split("\n")).strip()


def _progress(total: int, desc: str, enabled: bool, unit: str = "B"):
    """A tqdm bar on stderr, silent when stderr is not a terminal or progress is off."""
    from tqdm import tqdm

    show = enabled and sys.stderr.isatty()
    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        disable=not show,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )


def _checkpoint_dir(path: str) -> str:
    path = os.fspath(path)
    if os.path.basename(os.path.normpath(path)) == ".metadata" and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    return path


def _read_metadata(path: str):
    """(DCP Metadata, per-file table) of a committed DataStates checkpoint; ``read_commit``
    names what else the folder is (a folder of checkpoints, a stock DCP checkpoint ...)."""
    from .commit import read_commit

    return read_commit(path)


def _safe(text: Any) -> str:
    """A name taken from a checkpoint, printable: control characters (terminal escapes, line
    breaks) and other unprintable characters are shown as Python escapes."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _sharding(item) -> str:
    if item.kind != "tensor":
        return "-"
    if len(item.chunks) == 1 and list(item.chunks[0]["sizes"]) == list(item.shape):
        return "full"
    sizes = {tuple(c["sizes"]) for c in item.chunks}
    if len(sizes) == 1:
        return f"{len(item.chunks)} x {list(next(iter(sizes)))}"
    return f"{len(item.chunks)} chunks"


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ inspect
def _cmd_inspect(args) -> int:
    from .convert import checkpoint_items
    from .format.document import FORMAT_VERSION, REFERENCES_VERSION
    from .format.layout import FORMAT_NAME
    from .format.locations import split_reference
    from .storage import file_kind

    path = _checkpoint_dir(args.path)
    md, files = _read_metadata(path)
    items = checkpoint_items(md)
    on_disk: dict[str, int | str | None] = {}
    for name in files:
        try:
            # lstat: never follows a link out of the folder.
            st = os.lstat(os.path.join(path, name))
        except FileNotFoundError:
            on_disk[name] = None
            continue
        on_disk[name] = st.st_size if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
    sm = md.storage_meta
    total_items = sum(i.nbytes for i in items)
    # An incremental save's references: files of earlier checkpoints beside this one.
    referenced = {name: ref[0] for name in files if (ref := split_reference(name)) is not None}
    version = getattr(md.storage_data, "format_version", None) or (REFERENCES_VERSION if referenced else FORMAT_VERSION)
    if args.json:
        doc = {
            "path": path,
            "format": FORMAT_NAME,
            "version": version,
            "dcp_version": md.version,
            "save_id": getattr(sm, "save_id", None),
            "checkpoint_id": None if sm is None or sm.checkpoint_id is None else str(sm.checkpoint_id),
            "total_bytes": total_items,
            "files": {
                name: {"size": info.size, "size_on_disk": on_disk[name], "data_start": info.data_start, "piece_size": info.piece_size}
                for name, info in files.items()
            },
            "references": {
                checkpoint: sorted(n for n, c in referenced.items() if c == checkpoint)
                for checkpoint in sorted(set(referenced.values()))
            },
            "items": {
                i.fqn: (
                    {
                        "type": "tensor",
                        "dtype": i.dtype,
                        "shape": list(i.shape),
                        "nbytes": i.nbytes,
                        "requires_grad": i.requires_grad,
                        "chunks": i.chunks,
                    }
                    if i.kind == "tensor"
                    else {"type": "bytes", "nbytes": i.nbytes, **i.chunks[0]}
                )
                for i in items
            },
        }
        print(json.dumps(doc, indent=2))
        return 0

    ntensors = sum(1 for i in items if i.kind == "tensor")
    print(f"checkpoint: {_safe(path)}")
    dcp_version = f" (DCP metadata version {md.version})" if md.version else ""
    print(f"format:     {FORMAT_NAME} version {version}{dcp_version}")
    if sm is not None and sm.save_id:
        print(f"save id:    {_safe(sm.save_id)}")
    print(f"items:      {len(items)} ({ntensors} tensors, {len(items) - ntensors} other values), {_human(total_items)}")
    print(f"files:      {len(files)}, {_human(sum(f.size for f in files.values()))}")
    if referenced:
        own = sum(info.size for name, info in files.items() if name not in referenced)
        shown = ", ".join(_safe(c) for c in sorted(set(referenced.values())))
        print(f"references: {len(referenced)} file(s) of earlier checkpoint(s) {shown} (incremental save; "
              f"{_human(own)} written by this one)")
    print()
    rows = []
    for name, info in files.items():
        disk = on_disk[name]
        if isinstance(disk, str):
            state = f"NOT A REGULAR FILE ({disk})"
        else:
            state = "ok" if disk == info.size else ("MISSING" if disk is None else f"SIZE {disk} != {info.size}")
        rows.append([_safe(name), str(info.size), _human(info.size), state])
    print(_table(rows, ["FILE", "BYTES", "SIZE", "ON DISK"]))
    print()
    rows = []
    for i in items:
        shape = "[" + ", ".join(map(str, i.shape)) + "]" if i.kind == "tensor" else "-"
        files_of = sorted({c["file"] for c in i.chunks if c["file"]})
        where = files_of[0] if len(files_of) == 1 else f"{len(files_of)} files"
        rows.append([_safe(i.fqn), i.kind, i.dtype, shape, _sharding(i), _human(i.nbytes), _safe(where)])
    print(_table(rows, ["ITEM", "TYPE", "DTYPE", "SHAPE", "SHARDING", "SIZE", "FILE"]))
    if args.chunks:
        print()
        rows = []
        for i in items:
            if i.kind != "tensor":
                continue
            for c in i.chunks:
                rows.append(
                    [_safe(i.fqn), str(c["offsets"]), str(c["sizes"]), _safe(c["file"]), str(c["offset"]), str(c["length"]), str(c["pieces"])]
                )
        print(_table(rows, ["ITEM", "OFFSETS", "SIZES", "FILE", "FILE OFFSET", "BYTES", "CRC PIECES"]))
    return 0


# ------------------------------------------------------------------------------------- verify
def _cmd_verify(args) -> int:
    from .config import tool_config
    from .load.verify import verify_checkpoint
    from .runtime import get_engine

    path = _checkpoint_dir(args.path)
    report = verify_checkpoint(path, engine=get_engine(tool_config()),
                               progress=lambda total, desc: _progress(total, desc, not args.no_progress))
    if report.problems:
        for p in report.problems:
            print(f"FAILED {_safe(p)}", file=sys.stderr)
        print(f"{PROG} verify: {path} is damaged: {len(report.problems)} problem(s) found", file=sys.stderr)
        return 1
    extra = f"; {report.unchecked_items} item(s) carry no checksum" if report.unchecked_items else ""
    # An incremental save: files of earlier checkpoints, read and checked too.
    if report.referenced:
        extra += (f"; {len(report.referenced)} of the files are earlier checkpoints' "
                  f"({', '.join(_safe(c) for c in sorted(set(report.referenced)))}), checked too")
    print(
        f"OK {path}: {report.items} items in {report.files} file(s); "
        f"{report.checked_items} stored chunk(s), {_human(report.checked_bytes)}, match their CRC32C{extra}"
    )
    return 0


# ------------------------------------------------------------------------------------ convert
def _cmd_convert(args) -> int:
    from . import convert
    from .sizes import parse_size

    path = _checkpoint_dir(args.path)

    def progress(total: int, desc: str):
        return _progress(total, desc, not args.no_progress)

    if args.to == "hf":
        max_shard = parse_size(args.max_shard_size, name="--max-shard-size")
        if max_shard < 1:
            raise ValueError("--max-shard-size must be positive")
        done = convert.to_hf(path, args.out, max_shard_size=max_shard, prefix=args.prefix, hf_config=args.hf_config,
                             force=args.force, progress=progress)
        configs = "".join(f" + {name}" for name in done.config_files)
        print(f"wrote {done.out}: {done.items} tensors, {_human(done.nbytes)} in {len(done.files)} safetensors "
              f"file(s) + model.safetensors.index.json{configs}")
        if done.skipped:
            shown = ", ".join(done.skipped[:20]) + (f" and {len(done.skipped) - 20} more" if len(done.skipped) > 20 else "")
            print(f"skipped {len(done.skipped)} item(s) that a safetensors file cannot hold: {shown}")
        return 0
    if args.prefix:
        raise ValueError("--prefix applies to --to hf only")
    if args.hf_config:
        raise ValueError("--hf-config applies to --to hf only")
    # The conversion lives with the DeepSpeed integration.
    if args.to == "deepspeed":
        from .integrations.deepspeed import to_deepspeed

        done = to_deepspeed(path, args.out, force=args.force, trusted=args.trust)
        print(f"wrote {done.out}: {len(done.files)} DeepSpeed file(s), {_human(done.nbytes)} (torch.save): "
              f"{', '.join(done.files)}")
        return 0
    if args.to == "torch":
        done = convert.to_torch(path, args.out, force=args.force, trusted=args.trust, progress=progress)
        print(f"wrote {done.out}: {done.items} items, {_human(done.nbytes)} (torch.save)")
        return 0
    done = convert.to_dcp(path, args.out, force=args.force, trusted=args.trust, progress=progress)
    print(f"wrote {done.out}: {done.items} items, {_human(done.nbytes)} (DCP FileSystemWriter checkpoint)")
    return 0


# -------------------------------------------------------------------------------------- bench
def _cmd_bench(argv: list[str]) -> int:
    """Runs ``benchmarks/bench.py`` of the source checkout this package is installed from
    (``pip install -e .``): the benchmarks are tools, not part of the library."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.is_file():
        print(f"bench is not available in this build: it runs {script}, found in a source checkout "
              f"installed with pip install -e .", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("dcp_datastates_bench", script)
    bench = importlib.util.module_from_spec(spec)
    # Dataclasses resolve their module by name.
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return int(bench.main(argv) or 0)


# --------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify and convert dcp_datastates checkpoints.",
        epilog="Exit status: 0 ok, 1 error or damaged checkpoint, 2 usage error.",
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("inspect", help="list items, dtypes, shapes, shardings, files and sizes")
    s.add_argument("path", help="checkpoint folder (the one holding .metadata)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--chunks", action="store_true", help="also list every stored chunk of every tensor")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("verify", help="check every file's size and every item's CRC32C")
    s.add_argument("path", help="checkpoint folder")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_verify)

    s = sub.add_parser(
        "convert",
        help="write a consolidated Hugging Face safetensors folder, a torch.save file, a stock DCP checkpoint "
        "or DeepSpeed's own files of a tag",
    )
    s.add_argument("path", help="checkpoint folder")
    s.add_argument("out", help="output folder (hf, dcp, deepspeed) or file (torch)")
    s.add_argument("--to", required=True, choices=("hf", "torch", "dcp", "deepspeed"),
                   help="output format (deepspeed: a DeepSpeed tag folder of torch.save files, for zero_to_fp32)")
    s.add_argument(
        "--max-shard-size",
        default="5GB",
        help="hf: largest tensor bytes per safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB; a bare number is bytes)",
    )
    s.add_argument("--prefix", default=None, help="hf: convert only items whose name starts with PREFIX, and strip it (e.g. 'model.')")
    s.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="hf: write config.json into OUT so that from_pretrained(OUT) loads it alone; PATH is a config.json file "
        "or a folder holding one (a model folder: its config.json and generation_config.json are copied)",
    )
    s.add_argument("--force", action="store_true", help="write into a non-empty output folder / over an existing file")
    s.add_argument(
        "--trust",
        action="store_true",
        help="decode non-tensor values without restriction: RUNS CODE FROM THE CHECKPOINT; only for checkpoints "
        "whose writer you trust (default: only what torch.load(weights_only=True) accepts)",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_convert)

    sub.add_parser("bench", help="benchmarks (arguments go to benchmarks/bench.py)", add_help=False)
    return p


def _error_message(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        # DCP wraps the failure of each rank; show the first cause, not DCP's traceback text.
        for _rank, (cause, _trace) in sorted(exc.failures.items()):
            return _error_message(cause)
    if isinstance(exc, FileNotFoundError) and exc.filename and not str(exc).startswith("no "):
        return f"{exc.strerror or 'not found'}: {exc.filename}"
    return _one_line(str(exc)) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (never calls sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # --help, --version, usage errors.
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    from torch.distributed.checkpoint.api import CheckpointException

    from .errors import DataStatesError

    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process load/save; the command line is single-process.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return int(args.func(args))
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            # So the interpreter's final flush stays quiet.
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except (DataStatesError, OSError, ValueError, CheckpointException) as exc:
        print(f"{PROG} {args.command}: error: {_safe(_error_message(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a missing fsspec backend (ImportError) and the like
        print(f"{PROG} {args.command}: error: {type(exc).__name__}: {_safe(_error_message(exc))}", file=sys.stderr)
        return 1
