#!/usr/bin/env python
"""Long fuzzing run of the metadata decoder, the data-file header parser and the decoder of
stored non-tensor values.

    python scripts/fuzz.py --examples 100000            # both parsers, 100000 inputs per strategy
    python scripts/fuzz.py --examples 20000 --only header
    python scripts/fuzz.py --examples 20000 --only values

Runs the properties of tests/test_fuzz.py (only CheckpointFormatError may escape; what is
accepted is consistent) with many more examples, random (not derandomized) unless --seed is
given. Exits 1 on the first failure, after hypothesis prints the minimal failing input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import test_fuzz as props  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=100000, help="inputs per strategy (default 100000)")
    ap.add_argument("--only", choices=["metadata", "header", "values"], help="fuzz one parser only")
    ap.add_argument("--seed", type=int, help="reproducible run")
    args = ap.parse_args(argv)

    cfg = settings(
        max_examples=args.examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
    )

    def wrap(fn):
        fn = cfg(fn)
        return seed(args.seed)(fn) if args.seed is not None else fn

    @wrap
    @given(st.binary(max_size=4096))
    def metadata_bytes(raw):
        props.check_metadata(raw)

    @wrap
    @given(props.mutated_metadata())
    def metadata_mutations(raw):
        props.check_metadata(raw)

    @wrap
    @given(st.binary(max_size=1024), st.one_of(st.none(), st.integers(0, 2**40)))
    def header_bytes(data, size):
        props.check_header(data, size if size is None or size >= len(data) else None)

    @wrap
    @given(props.header_files())
    def header_mutations(case):
        props.check_header(*case)

    @wrap
    @given(st.binary(max_size=2048))
    def value_bytes(raw):
        props.check_value(raw)

    @wrap
    @given(props.mutated_values())
    def value_mutations(raw):
        props.check_value(raw)

    runs = []
    if args.only in (None, "metadata"):
        runs += [metadata_bytes, metadata_mutations]
    if args.only in (None, "header"):
        runs += [header_bytes, header_mutations]
    if args.only in (None, "values"):
        runs += [value_bytes, value_mutations]
    for fn in runs:
        t0 = time.perf_counter()
        print(f"fuzz {fn.__name__}: {args.examples} examples ...", flush=True)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and fail
            print(f"FAILED {fn.__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"  ok in {time.perf_counter() - t0:.1f} s", flush=True)
    print("fuzz: no exception other than CheckpointFormatError")
    return 0


if __name__ == "__main__":
    sys.exit(main())
