"""The ``dcp-datastates`` command line (also ``python -m dcp_datastates``).

    dcp-datastates inspect PATH [--json] [--chunks]
    dcp-datastates verify PATH
    dcp-datastates convert PATH OUT --to hf|torch|dcp [--max-shard-size 5GB] [--prefix model.]
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
from collections import defaultdict
from typing import Any, Iterable

__all__ = ["main"]

PROG = "dcp-datastates"

# Bytes read per engine call when verifying (checksum pieces are at most the engine's chunk size).
_VERIFY_WINDOW_BYTES = 64 << 20


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


def _file_kind(mode: int) -> str:
    from .commit import file_kind

    return file_kind(mode)


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
    from .layout import FORMAT_NAME
    from .metadata import FORMAT_VERSION

    path = _checkpoint_dir(args.path)
    md, files = _read_metadata(path)
    items = checkpoint_items(md)
    on_disk: dict[str, int | str | None] = {}
    for name in files:
        try:
            st = os.lstat(os.path.join(path, name))  # never follows a link out of the folder
        except FileNotFoundError:
            on_disk[name] = None
            continue
        on_disk[name] = st.st_size if stat.S_ISREG(st.st_mode) else _file_kind(st.st_mode)
    sm = md.storage_meta
    total_items = sum(i.nbytes for i in items)
    if args.json:
        doc = {
            "path": path,
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dcp_version": md.version,
            "save_id": getattr(sm, "save_id", None),
            "checkpoint_id": None if sm is None or sm.checkpoint_id is None else str(sm.checkpoint_id),
            "total_bytes": total_items,
            "files": {
                name: {"size": info.size, "size_on_disk": on_disk[name], "data_start": info.data_start, "piece_size": info.piece_size}
                for name, info in files.items()
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
    print(f"format:     {FORMAT_NAME} version {FORMAT_VERSION}{dcp_version}")
    if sm is not None and sm.save_id:
        print(f"save id:    {_safe(sm.save_id)}")
    print(f"items:      {len(items)} ({ntensors} tensors, {len(items) - ntensors} other values), {_human(total_items)}")
    print(f"files:      {len(files)}, {_human(sum(f.size for f in files.values()))}")
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
def _check_header(full: str, name: str, info, locs: list) -> list[str]:
    """The data file is a safetensors file whose header lists every item at its recorded place."""
    import struct

    problems = []
    try:
        with _open_regular(full) as f:
            head = f.read(8)
            if len(head) < 8:
                return [f"{name}: header damaged (file shorter than 8 bytes)"]
            (hlen,) = struct.unpack("<Q", head)
            if 8 + hlen != info.data_start:
                return [f"{name}: header damaged (header length {hlen} does not end at the data start {info.data_start})"]
            header = json.loads(f.read(hlen))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return [f"{name}: header damaged (not valid safetensors JSON: {exc})"]
    except OSError as exc:
        return [f"{name}: cannot read the header: {_one_line(exc)}"]
    except ValueError as exc:  # CheckpointFormatError: not a regular file
        return [_one_line(exc)]
    if not isinstance(header, dict):
        return [f"{name}: header damaged (not a JSON object)"]
    spans = set()
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            spans.add((info.data_start + int(begin), int(end) - int(begin)))
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: header damaged (entry {key!r} has no valid data_offsets)")
    unlisted = [(label, loc) for label, loc in locs if (loc.offset, loc.length) not in spans]
    for label, loc in unlisted[:10]:
        problems.append(f"{name}: header does not list {label} at bytes [{loc.offset}, {loc.offset + loc.length})")
    if len(unlisted) > 10:
        problems.append(f"{name}: header does not list {len(unlisted) - 10} more item(s)")
    return problems


def _open_regular(full: str):
    """A data file opened for reading without following a link or blocking on a FIFO."""
    from .commit import open_for_reading

    return os.fdopen(open_for_reading(full), "rb")


def _label(index) -> str:
    if index.offset is None:
        return f"item {index.fqn!r}"
    return f"item {index.fqn!r} (chunk offsets {list(index.offset)})"


def _cmd_verify(args) -> int:
    import torch

    from .config import tool_config
    from .metadata import piece_ranges
    from .runtime import get_engine

    path = _checkpoint_dir(args.path)
    md, files = _read_metadata(path)
    problems: list[str] = []
    by_file: dict[str, list] = defaultdict(list)
    for index, loc in md.storage_data.items():
        by_file[loc.file].append((_label(index), loc))

    readable = []
    for name, info in files.items():
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)  # a link is reported, never followed out of the folder
        except FileNotFoundError:
            problems.append(f"{_safe(name)}: data file is missing ({len(by_file[name])} items cannot be read)")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{_safe(name)}: data file is {_file_kind(st.st_mode)}, not a regular file (not read)")
            continue
        size = st.st_size
        if size != info.size:
            how = "truncated" if size < info.size else "longer than recorded"
            lost = [label for label, loc in by_file[name] if loc.offset + loc.length > size]
            detail = ""
            if size < info.size and lost:
                detail = f"; past the end: {', '.join(lost[:5])}" + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
            problems.append(f"{name}: {how}: {size} bytes on disk, the metadata records {info.size}{detail}")
            continue
        header_problems = _check_header(full, name, info, by_file[name])
        problems += header_problems
        readable.append(name)

    engine = get_engine(tool_config())
    total = sum(loc.length for name in readable for _, loc in by_file[name])
    checked_items = unchecked_items = 0
    checked_bytes = 0
    with _progress(total, "verify", not args.no_progress) as bar:
        for name in readable:
            full = os.path.join(path, name)
            pieces = []  # (label, loc, expected, offset, length)
            for label, loc in sorted(by_file[name], key=lambda x: x[1].offset):
                if not loc.crc32c:
                    if loc.length:
                        unchecked_items += 1
                    bar.update(loc.length)
                    continue
                checked_items += 1
                for expected, (off, length) in zip(loc.crc32c, piece_ranges(loc)):
                    pieces.append((label, loc, expected, off, length))
            window = max([_VERIFY_WINDOW_BYTES] + [p[4] for p in pieces])
            buf = torch.empty(window if pieces else 0, dtype=torch.uint8)
            base = buf.data_ptr()
            for batch in _batches(pieces, window):
                ranges, pos = [], 0
                for p in batch:
                    ranges.append((base + pos, p[3], p[4]))
                    pos += p[4]
                try:
                    engine.read_into(full, ranges)
                except (OSError, ValueError) as exc:
                    first, last = batch[0], batch[-1]
                    problems.append(f"{name}: cannot read bytes [{first[3]}, {last[3] + last[4]}): {_one_line(exc)}")
                    bar.update(pos)
                    continue
                pos = 0
                for label, loc, expected, off, length in batch:
                    got = engine.crc32c(base + pos, length)
                    pos += length
                    if got != expected:
                        problems.append(
                            f"{name}: checksum mismatch in {label}, bytes [{off}, {off + length}): "
                            f"stored crc32c {expected:#010x}, read {got:#010x}"
                        )
                checked_bytes += pos
                bar.update(pos)

    if problems:
        for p in problems:
            print(f"FAILED {p}", file=sys.stderr)
        print(f"{PROG} verify: {path} is damaged: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    extra = f"; {unchecked_items} item(s) carry no checksum" if unchecked_items else ""
    print(
        f"OK {path}: {len(md.state_dict_metadata)} items in {len(files)} file(s); "
        f"{checked_items} stored chunk(s), {_human(checked_bytes)}, match their CRC32C{extra}"
    )
    return 0


def _batches(pieces: list, window: int) -> Iterable[list]:
    batch, size = [], 0
    for p in pieces:
        if batch and size + p[4] > window:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p[4]
    if batch:
        yield batch


# ------------------------------------------------------------------------------------ convert
def _cmd_convert(args) -> int:
    from . import convert
    from .config import parse_size

    path = _checkpoint_dir(args.path)

    def progress(total: int, desc: str):
        return _progress(total, desc, not args.no_progress)

    if args.to == "hf":
        max_shard = parse_size(args.max_shard_size, name="--max-shard-size")
        if max_shard < 1:
            raise ValueError("--max-shard-size must be positive")
        done = convert.to_hf(path, args.out, max_shard_size=max_shard, prefix=args.prefix, force=args.force,
                             progress=progress)
        print(f"wrote {done.out}: {done.items} tensors, {_human(done.nbytes)} in {len(done.files)} safetensors "
              f"file(s) + model.safetensors.index.json")
        if done.skipped:
            shown = ", ".join(done.skipped[:20]) + (f" and {len(done.skipped) - 20} more" if len(done.skipped) > 20 else "")
            print(f"skipped {len(done.skipped)} item(s) that a safetensors file cannot hold: {shown}")
        return 0
    if args.prefix:
        raise ValueError("--prefix applies to --to hf only")
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
    sys.modules[spec.name] = bench  # dataclasses resolve their module by name
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
        help="write a consolidated Hugging Face safetensors folder, a torch.save file or a stock DCP checkpoint",
    )
    s.add_argument("path", help="checkpoint folder")
    s.add_argument("out", help="output folder (hf, dcp) or file (torch)")
    s.add_argument("--to", required=True, choices=("hf", "torch", "dcp"), help="output format")
    s.add_argument(
        "--max-shard-size",
        default="5GB",
        help="hf: largest tensor bytes per safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB; a bare number is bytes)",
    )
    s.add_argument("--prefix", default=None, help="hf: convert only items whose name starts with PREFIX, and strip it (e.g. 'model.')")
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
    except SystemExit as exc:  # --help, --version, usage errors
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
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
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
