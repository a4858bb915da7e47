// XXH64 (seed 0), written from the published xxHash specification (doc/xxhash_spec.md): a fast
// 64-bit content hash, used to tell whether a tensor's bytes are unchanged since an earlier
// checkpoint (incremental saves). Not a checksum of what is on disk (that is crc32c.h) and not
// cryptographic: it detects change, it does not resist an adversary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcpds {

// Streaming XXH64: update() any number of times, then digest(). An item held in several
// non-contiguous segments hashes as their concatenation, whatever the cut points.
class Hash64 {
 public:
  Hash64();

  // Appends data[0, n); data may be null when n == 0.
  void update(const void* data, size_t n);

  // XXH64 of everything appended so far; the state is unchanged, so updates may continue.
  uint64_t digest() const;

 private:
  uint64_t acc_[4];        // the four lane accumulators (spec step 1)
  unsigned char buf_[32];  // bytes of a stripe not yet complete
  size_t buffered_;        // how many of buf_ hold input, < 32
  uint64_t total_;         // input length so far
};

// XXH64 with seed 0 of data[0, n). hash64(nullptr, 0) == 0xEF46DB3751D8E999.
uint64_t hash64(const void* data, size_t n);

}  // namespace dcpds
