"""When a lazy save is staged (the training step may run) and when it is durable, for the bench's
default state (1 GiB in 2,256 tensors: 256 large fp32, the rest tiny), with the engine's
``direct_writes`` off (copies into the host cache first) or on (the flush writes straight from the
tensors; staged only once written). Medians after 2 warm-up saves; each checkpoint is removed
before the next.

    python scripts/staged_vs_durable.py --dir /tmp/svd [--direct-writes on|off] [--saves 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--direct-writes", choices=("on", "off"), default="off")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--json")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    big, tiny = 256, 2000
    g = torch.Generator().manual_seed(0)
    per = args.mib * (1 << 20) // big // 4
    model = {f"layers.{i // 8}.w{i % 8}": torch.randn(per if i < big else 16, generator=g) for i in range(big + tiny)}
    state = {"model": model, "step": 3}
    staged, durable = [], []
    for k in range(args.saves):
        path = f"{args.dir}/ckpt-{k}"
        t0 = time.monotonic()
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, direct_writes=args.direct_writes == "on"))
        resp.staging_completion.result()
        t1 = time.monotonic()
        resp.upload_completion.result()
        t2 = time.monotonic()
        if k >= 2:
            staged.append(t1 - t0)
            durable.append(t2 - t0)
        shutil.rmtree(path)
    out = {"direct_writes": args.direct_writes, "staged_s": statistics.median(staged),
           "durable_s": statistics.median(durable), "staged_samples": staged, "durable_samples": durable}
    print(f"direct_writes={args.direct_writes}: staged {out['staged_s']:.3f} s, durable {out['durable_s']:.3f} s "
          f"(medians of {len(durable)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
