#include "copy.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace dcpds {

void check_copy_device(int device) {
  if (device != kHostDevice)
    throw std::invalid_argument("device " + std::to_string(device) +
                                " is not supported: only host memory (device=-1) can be copied");
}

void copy_bytes(void* dst, const void* src, size_t nbytes, int device) {
  check_copy_device(device);
  if (nbytes) std::memcpy(dst, src, nbytes);
}

}  // namespace dcpds
