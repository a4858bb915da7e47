// The one place bytes move from a source into the host cache. A device copy (CUDA runtime,
// dlopen'ed later) plugs in here; today only host memory (device == -1) is supported.
#pragma once

#include <cstddef>

namespace dcpds {

constexpr int kHostDevice = -1;

// Throws std::invalid_argument for a device this build cannot copy from.
void check_copy_device(int device);

// Copies nbytes from src (on `device`) to host memory dst. Throws std::invalid_argument for an
// unsupported device.
void copy_bytes(void* dst, const void* src, size_t nbytes, int device);

}  // namespace dcpds
