#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define DCPDS_X86 1
#endif

namespace dcpds {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : (c >> 1);
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables tabs;
  return tabs;
}

// Raw register update (no pre/post inversion).
uint32_t update_software(uint32_t crc, const unsigned char* p, size_t n) {
  const Tables& T = tables();
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;  // little-endian layout assumed (x86/ARM Linux)
    crc = T.t[7][lo & 0xFF] ^ T.t[6][(lo >> 8) & 0xFF] ^ T.t[5][(lo >> 16) & 0xFF] ^ T.t[4][lo >> 24] ^
          T.t[3][hi & 0xFF] ^ T.t[2][(hi >> 8) & 0xFF] ^ T.t[1][(hi >> 16) & 0xFF] ^ T.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ T.t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#ifdef DCPDS_X86

// Multiplication in GF(2)[x] mod P, bit-reflected (bit 31 is x^0). Used to "shift" a CRC
// register over a run of zero bytes so independent streams can be combined.
uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) prod ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : (b >> 1);  // b *= x
  }
  return prod;
}

// x^(8 * nbytes) mod P: the operator "append nbytes zero bytes" on a raw register.
uint32_t zeros_operator(uint64_t nbytes) {
  uint32_t result = 0x80000000u;  // 1
  uint32_t base = 0x40000000u;    // x
  for (uint64_t e = nbytes * 8; e; e >>= 1) {
    if (e & 1) result = gf2_mulmod(result, base);
    base = gf2_mulmod(base, base);
  }
  return result;
}

// Three independent streams hide the 3-cycle latency of the crc32 instruction.
constexpr size_t kStride = 8192;

struct Shifts {
  uint32_t one = zeros_operator(kStride);
  uint32_t two = zeros_operator(2 * kStride);
};

const Shifts& shifts() {
  static const Shifts s;
  return s;
}

__attribute__((target("sse4.2"))) uint32_t update_hardware(uint32_t crc32, const unsigned char* p, size_t n) {
  uint64_t crc = crc32;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
    --n;
  }
  if (n >= 3 * kStride) {
    const Shifts& sh = shifts();
    while (n >= 3 * kStride) {
      uint64_t c0 = crc, c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStride; i += 8) {
        uint64_t v0, v1, v2;
        std::memcpy(&v0, p + i, 8);
        std::memcpy(&v1, p + kStride + i, 8);
        std::memcpy(&v2, p + 2 * kStride + i, 8);
        c0 = _mm_crc32_u64(c0, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
      }
      // crc(A|B|C) = shift(cA, 2L) ^ shift(cB, L) ^ cC, by linearity of the raw register.
      crc = gf2_mulmod(static_cast<uint32_t>(c0), sh.two) ^ gf2_mulmod(static_cast<uint32_t>(c1), sh.one) ^
            static_cast<uint32_t>(c2);
      p += 3 * kStride;
      n -= 3 * kStride;
    }
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    crc = _mm_crc32_u64(crc, v);
    p += 8;
    n -= 8;
  }
  while (n--) crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
  return static_cast<uint32_t>(crc);
}

bool detect_hardware() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#endif  // DCPDS_X86

using UpdateFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

UpdateFn pick_update() {
#ifdef DCPDS_X86
  if (detect_hardware()) return update_hardware;
#endif
  return update_software;
}

UpdateFn update_fn() {
  static const UpdateFn fn = pick_update();
  return fn;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t seed) {
  if (n == 0) return seed;
  return ~update_fn()(~seed, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_software(const void* data, size_t n, uint32_t seed) {
  if (n == 0) return seed;
  return ~update_software(~seed, static_cast<const unsigned char*>(data), n);
}

bool crc32c_hardware_available() { return update_fn() != update_software; }

}  // namespace dcpds
