// Shared by the stress drivers (csrc/tests/stress_main.cpp, tests/cuda_double/stress_cuda.cpp):
// a CHECK that counts failures instead of stopping, and whole-file reads for byte comparisons.
#pragma once

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace stress {

inline std::atomic<int> g_failures{0};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace stress

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::fprintf(stderr, "CHECK failed: %s: ", #cond); \
      std::fprintf(stderr, __VA_ARGS__);                 \
      std::fprintf(stderr, "\n");                        \
      stress::g_failures.fetch_add(1);                   \
    }                                                    \
  } while (0)
