// CRC32C (Castagnoli): AVX-512 carry-less-multiply folding or the SSE4.2 crc32 instruction when
// the CPU has them, table-driven software otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dcpds {

// Standard CRC32C of data[0, n). `seed` is a previous result, so chunks chain:
// crc32c(b, nb, crc32c(a, na)) == crc32c(a + b). crc32c(nullptr, 0) == 0.
uint32_t crc32c(const void* data, size_t n, uint32_t seed = 0);

// The portable implementation, always available (tests compare both paths).
uint32_t crc32c_software(const void* data, size_t n, uint32_t seed = 0);

// True when crc32c() uses a hardware path.
bool crc32c_hardware_available();

// The implementations this CPU runs, fastest (the one crc32c() uses) first:
// "avx512-vpclmulqdq", "sse4.2", "software".
std::vector<std::string> crc32c_implementations();

// crc32c() through the named implementation (tests compare them); throws
// std::invalid_argument for one this CPU does not run.
uint32_t crc32c_using(const std::string& name, const void* data, size_t n, uint32_t seed = 0);

}  // namespace dcpds
