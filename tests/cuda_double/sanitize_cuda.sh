#!/usr/bin/env bash
# The engine's CUDA path under ThreadSanitizer and AddressSanitizer+UBSan: builds the runtime
# double (fake_cudart.cpp) and the stress driver (stress_cuda.cpp + csrc/*.cpp except the
# bindings) with each sanitizer, and runs the driver against the double.
# Usage: tests/cuda_double/sanitize_cuda.sh [build_dir]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$(mktemp -d /tmp/dcpds_sanitize_cuda.XXXXXX)}"
mkdir -p "$out"
cxx="${CXX:-g++}"
srcs=()
for f in "$root"/csrc/*.cpp; do
  [[ "$(basename "$f")" == bindings.cpp ]] || srcs+=("$f")
done
common=(-std=c++17 -O1 -g -fno-omit-frame-pointer -pthread -Wall -Wextra -Werror)

for kind in tsan asan; do
  if [[ $kind == tsan ]]; then san=(-fsanitize=thread); else san=(-fsanitize=address,undefined -fno-sanitize-recover=undefined); fi
  echo "== building ($kind)"
  "$cxx" "${common[@]}" "${san[@]}" -shared -fPIC "$here/fake_cudart.cpp" -o "$out/libfake_cudart_$kind.so"
  "$cxx" "${common[@]}" "${san[@]}" -I"$root/csrc" "${srcs[@]}" "$here/stress_cuda.cpp" -o "$out/stress_cuda_$kind" -ldl
done
echo "== running under ThreadSanitizer"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "$out/stress_cuda_tsan" "$out/libfake_cudart_tsan.so"
echo "== running under AddressSanitizer + UndefinedBehaviorSanitizer"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$out/stress_cuda_asan" "$out/libfake_cudart_asan.so"
echo "== CUDA path sanitizers: clean"
