// CRC32C (Castagnoli): SSE4.2 when the CPU has it, table-driven software otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcpds {

// Standard CRC32C of data[0, n). `seed` is a previous result, so chunks chain:
// crc32c(b, nb, crc32c(a, na)) == crc32c(a + b). crc32c(nullptr, 0) == 0.
uint32_t crc32c(const void* data, size_t n, uint32_t seed = 0);

// The portable implementation, always available (tests compare both paths).
uint32_t crc32c_software(const void* data, size_t n, uint32_t seed = 0);

// True when crc32c() uses the SSE4.2 instruction.
bool crc32c_hardware_available();

}  // namespace dcpds
