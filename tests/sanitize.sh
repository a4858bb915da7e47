#!/usr/bin/env bash
# Builds the standalone engine stress driver (csrc/tests/stress_main.cpp + csrc/*.cpp except the
# pybind11 bindings) under ThreadSanitizer and under AddressSanitizer+UBSan, and runs both; then the
# same for the CUDA path: tests/cuda_double/stress_cuda.cpp against the CUDA runtime double.
# Usage: tests/sanitize.sh [build_dir]   (needs g++ or clang++ with sanitizer runtimes)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$(mktemp -d /tmp/dcpds_sanitize.XXXXXX)}"
mkdir -p "$out"
cxx="${CXX:-g++}"
srcs=()
for f in "$root"/csrc/*.cpp; do
  [[ "$(basename "$f")" == bindings.cpp ]] || srcs+=("$f")
done
common=(-std=c++17 -O1 -g -fno-omit-frame-pointer -pthread -Wall -Wextra -Werror -I"$root/csrc")

tsan=(-fsanitize=thread)
asan=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
double="$root/tests/cuda_double"

echo "== building with -fsanitize=thread"
"$cxx" "${common[@]}" "${tsan[@]}" "${srcs[@]}" "$root/csrc/tests/stress_main.cpp" -o "$out/stress_tsan" -ldl
"$cxx" "${common[@]}" "${tsan[@]}" "${srcs[@]}" "$double/stress_cuda.cpp" -o "$out/stress_cuda_tsan" -ldl
"$cxx" "${common[@]}" "${tsan[@]}" -shared -fPIC "$double/fake_cudart.cpp" -o "$out/libfake_cudart_tsan.so"
echo "== building with -fsanitize=address,undefined"
"$cxx" "${common[@]}" "${asan[@]}" "${srcs[@]}" "$root/csrc/tests/stress_main.cpp" -o "$out/stress_asan" -ldl
"$cxx" "${common[@]}" "${asan[@]}" "${srcs[@]}" "$double/stress_cuda.cpp" -o "$out/stress_cuda_asan" -ldl
"$cxx" "${common[@]}" "${asan[@]}" -shared -fPIC "$double/fake_cudart.cpp" -o "$out/libfake_cudart_asan.so"

echo "== running under ThreadSanitizer"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "$out/stress_tsan"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "$out/stress_cuda_tsan" "$out/libfake_cudart_tsan.so"
echo "== running under AddressSanitizer + UndefinedBehaviorSanitizer"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" "$out/stress_asan"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$out/stress_cuda_asan" "$out/libfake_cudart_asan.so"
echo "== sanitizers: clean"
