#!/usr/bin/env bash
# One GPU session on a lent machine (PyTorch preinstalled, no package registry): build the engine
# in place, run the GPU tests, then the GPU benchmark with the given arguments. Peers travel as
# wheels in .whl/ (see docs/benchmarks.md, "GPU"). Logs and JSON go to $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh [tests|load|bench|sidebyside|all] [gpu_bench.py arguments...]
# "load" (in "all" too, between the tests and the benchmark: about a minute) profiles a load into
# CUDA tensors step by step (benchmarks/load_profile.py; docs/benchmarks.md "GPU").
# "sidebyside" (not in "all", which with it would pass a call's 600 s: a second call) runs
# `bench --device cuda` cut to 512 MiB with every method, the peers included (wheels from .whl/),
# stopped with SIGINT after SIDEBYSIDE_S seconds (default 420): the bench then writes what it measured.
# The wheels, fetched here before the session (the lent machine has no package registry; it has
# the peers' other dependencies), with .whl/ in .git/info/exclude and carried:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform any -d .whl torch-checkpointing==0.1.1 torchsnapshot==0.1.0 lazy_importer \
#     importlib-metadata nest-asyncio
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
what="${1:-all}"; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$out/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace -j "$(nproc)" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
rc=0
if [[ "$what" == tests || "$what" == all ]]; then
  python3 -m pytest -q -p no:logging -m gpu tests/test_gpu.py -ra 2>&1 | tee "$out/pytest_gpu.log" || rc=1
fi
if [[ "$what" == load || "$what" == all ]]; then
  python3 benchmarks/load_profile.py --device cuda --size 512MiB --loads 3 --json "$out/load_profile.json" 2>&1 \
    | tee "$out/load_profile.log" || rc=1
fi
if [[ "$what" == bench || "$what" == all ]]; then
  df -h /tmp | tail -1; free -g | head -2
  python3 benchmarks/gpu_bench.py --ckpt-dir /tmp/gpu_bench --out "$out/gpu_bench.json" "$@" 2>&1 | tee "$out/gpu_bench.log" || rc=1
fi
if [[ "$what" == sidebyside ]]; then
  timeout -s INT "${SIDEBYSIDE_S:-420}" python3 -m dcp_datastates bench --device cuda --size 512MiB --reps 3 --mem-ckpts 3 --load-reps 2 \
    --cold no --stage-tensors 0 --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.log" || rc=1
fi
exit $rc
