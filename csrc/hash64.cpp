#include "hash64.h"

#include <cstring>

namespace dcpds {
namespace {

// The five primes of the specification.
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

constexpr size_t kStripe = 32;  // 4 lanes of 8 bytes

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Little-endian loads at any alignment (memcpy compiles to a plain load).
template <class T>
inline T load_le(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  if constexpr (sizeof(T) == 8)
    v = __builtin_bswap64(v);
  else
    v = __builtin_bswap32(v);
#endif
  return v;
}

inline uint64_t le64(const unsigned char* p) { return load_le<uint64_t>(p); }
inline uint64_t le32(const unsigned char* p) { return load_le<uint32_t>(p); }

// Step 2's round: one 8-byte lane into one accumulator.
inline uint64_t lane_round(uint64_t acc, uint64_t lane) {
  acc += lane * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}

// Step 3's mergeAccumulator.
inline uint64_t merge(uint64_t acc, uint64_t lane_acc) {
  acc ^= lane_round(0, lane_acc);
  return acc * kP1 + kP4;
}

// Consumes the whole stripes of p[0, n) into acc; returns the bytes consumed (a multiple of 32).
// The accumulators live in locals for the loop: stores through acc could alias the input (it is
// read as unsigned char), which would force the compiler to reload them every stripe.
size_t consume_stripes(uint64_t acc[4], const unsigned char* p, size_t n) {
  const size_t whole = n - n % kStripe;
  uint64_t a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
  for (const unsigned char* const end = p + whole; p != end; p += kStripe) {
    a0 = lane_round(a0, le64(p));
    a1 = lane_round(a1, le64(p + 8));
    a2 = lane_round(a2, le64(p + 16));
    a3 = lane_round(a3, le64(p + 24));
  }
  acc[0] = a0;
  acc[1] = a1;
  acc[2] = a2;
  acc[3] = a3;
  return whole;
}

}  // namespace

Hash64::Hash64() : acc_{kP1 + kP2, kP2, 0, 0 - kP1}, buf_{}, buffered_(0), total_(0) {}

void Hash64::update(const void* data, size_t n) {
  if (n == 0) return;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ > 0) {  // complete the stripe an earlier update left open
    const size_t take = n < kStripe - buffered_ ? n : kStripe - buffered_;
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    n -= take;
    if (buffered_ < kStripe) return;
    consume_stripes(acc_, buf_, kStripe);
    buffered_ = 0;
  }
  const size_t done = consume_stripes(acc_, p, n);
  p += done;
  n -= done;
  if (n > 0) {
    std::memcpy(buf_, p, n);
    buffered_ = n;
  }
}

uint64_t Hash64::digest() const {
  uint64_t h;
  if (total_ >= kStripe) {  // step 3: converge the four accumulators
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    h = merge(h, acc_[0]);
    h = merge(h, acc_[1]);
    h = merge(h, acc_[2]);
    h = merge(h, acc_[3]);
  } else {  // under one stripe: the single-accumulator start (seed 0 + P5)
    h = kP5;
  }
  h += total_;  // step 4

  // Step 5: the < 32 bytes after the last whole stripe (all of the input when it is that short).
  const unsigned char* p = buf_;
  size_t left = buffered_;
  for (; left >= 8; p += 8, left -= 8) {
    h ^= lane_round(0, le64(p));
    h = rotl(h, 27) * kP1 + kP4;
  }
  if (left >= 4) {
    h ^= le32(p) * kP1;
    h = rotl(h, 23) * kP2 + kP3;
    p += 4;
    left -= 4;
  }
  for (; left > 0; ++p, --left) {
    h ^= static_cast<uint64_t>(*p) * kP5;
    h = rotl(h, 11) * kP1;
  }

  // Step 6: avalanche.
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t hash64(const void* data, size_t n) {
  Hash64 h;
  h.update(data, n);
  return h.digest();
}

}  // namespace dcpds
