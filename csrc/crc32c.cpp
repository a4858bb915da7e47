#include "crc32c.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
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

// x^e mod P, bit-reflected.
uint32_t xpow_mod(uint64_t e) {
  uint32_t result = 0x80000000u;  // 1
  uint32_t base = 0x40000000u;    // x
  for (; e; e >>= 1) {
    if (e & 1) result = gf2_mulmod(result, base);
    base = gf2_mulmod(base, base);
  }
  return result;
}

// x^(8 * nbytes) mod P: the operator "append nbytes zero bytes" on a raw register.
uint32_t zeros_operator(uint64_t nbytes) { return xpow_mod(nbytes * 8); }

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

// ---- Folding with carry-less multiplication (AVX-512 VPCLMULQDQ): 16 independent 128-bit lanes.
//
// A 16-byte lane loaded little-endian holds, in reflected order, the polynomial
// A = L * x^64 + H (L: its first 8 bytes, H: the last 8). Moving it D bits further down the
// message multiplies it by x^D, and modulo P that is L * (x^(D+64) mod P) + H * (x^D mod P):
// two carry-less 64x32-bit products, at most 96 bits, so the result is again one lane that can
// be XORed onto the data D bits later. With a 32-bit reflected constant K in the low half of a
// qword, the product of a reflected qword U by it reads as the lane U * K * x^33, hence the
// constants x^(D+31) and x^(D-33) below. At the end the one remaining lane is congruent to the
// whole prefix modulo P, so the crc32 instruction over its 16 bytes (from a zero register)
// gives the prefix's CRC register.

struct FoldKeys {
  uint64_t lo, hi;  // for L (first 8 bytes) and H (last 8 bytes) of a lane
};

FoldKeys fold_keys(uint64_t distance_bits) {
  return FoldKeys{xpow_mod(distance_bits + 31), xpow_mod(distance_bits - 33)};
}

struct ClmulKeys {
  FoldKeys by256, by64, by48, by32, by16;  // fold distance in bytes
  ClmulKeys()
      : by256(fold_keys(256 * 8)), by64(fold_keys(64 * 8)), by48(fold_keys(48 * 8)), by32(fold_keys(32 * 8)),
        by16(fold_keys(16 * 8)) {}
};

const ClmulKeys& clmul_keys() {
  static const ClmulKeys k;
  return k;
}

constexpr size_t kClmulMin = 1024;  // below this the crc32 instruction path is as fast

#define DCPDS_CLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

DCPDS_CLMUL_TARGET inline __m512i fold512(__m512i x, __m512i keys, __m512i data) {
  const __m512i a = _mm512_clmulepi64_epi128(x, keys, 0x00);  // L * key.lo
  const __m512i b = _mm512_clmulepi64_epi128(x, keys, 0x11);  // H * key.hi
  return _mm512_ternarylogic_epi64(a, b, data, 0x96);          // a ^ b ^ data
}

DCPDS_CLMUL_TARGET inline __m128i fold128(__m128i x, const FoldKeys& k, __m128i data) {
  const __m128i keys = _mm_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo));
  const __m128i a = _mm_clmulepi64_si128(x, keys, 0x00);
  const __m128i b = _mm_clmulepi64_si128(x, keys, 0x11);
  return _mm_xor_si128(_mm_xor_si128(a, b), data);
}

DCPDS_CLMUL_TARGET inline __m512i broadcast_keys(const FoldKeys& k) {
  const long long lo = static_cast<long long>(k.lo), hi = static_cast<long long>(k.hi);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);  // (set, not a broadcast: see lanes below)
}

DCPDS_CLMUL_TARGET uint32_t update_clmul(uint32_t crc32, const unsigned char* p, size_t n) {
  if (n < kClmulMin) return update_hardware(crc32, p, n);
  const ClmulKeys& K = clmul_keys();
  // Four 64-byte accumulators over the first 256 bytes; the register enters as the first 4
  // bytes' XOR (a raw CRC update from register c equals one from 0 over data ^ c).
  __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, static_cast<int>(crc32)));
  p += 256;
  n -= 256;
  const __m512i k256 = broadcast_keys(K.by256);
  while (n >= 256) {
    x0 = fold512(x0, k256, _mm512_loadu_si512(p));
    x1 = fold512(x1, k256, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k256, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k256, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  // The four accumulators into the last, then its four lanes into its last lane.
  const __m512i k64 = broadcast_keys(K.by64);
  x1 = fold512(x0, k64, x1);
  x2 = fold512(x1, k64, x2);
  x3 = fold512(x2, k64, x3);
  alignas(64) __m128i lanes[4];  // through memory: GCC's extract intrinsics warn at -O1 (-Werror)
  _mm512_store_si512(lanes, x3);
  __m128i lane = fold128(lanes[0], K.by48, lanes[3]);
  lane = fold128(lanes[1], K.by32, lane);
  lane = fold128(lanes[2], K.by16, lane);
  uint64_t crc = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(lane)));
  crc = _mm_crc32_u64(crc, static_cast<uint64_t>(_mm_extract_epi64(lane, 1)));
  return update_hardware(static_cast<uint32_t>(crc), p, n);  // the last < 256 bytes
}

bool detect_clmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
}

#endif  // DCPDS_X86

using UpdateFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

struct Impl {
  const char* name;
  UpdateFn fn;
};

// Fastest first; each entry only where this CPU runs it.
std::vector<Impl> available_impls() {
  std::vector<Impl> out;
#ifdef DCPDS_X86
  if (detect_clmul()) out.push_back({"avx512-vpclmulqdq", update_clmul});
  if (detect_hardware()) out.push_back({"sse4.2", update_hardware});
#endif
  out.push_back({"software", update_software});
  return out;
}

const std::vector<Impl>& impls() {
  static const std::vector<Impl> v = available_impls();
  return v;
}

uint32_t run(UpdateFn fn, const void* data, size_t n, uint32_t seed) {
  if (n == 0) return seed;
  return ~fn(~seed, static_cast<const unsigned char*>(data), n);
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t seed) { return run(impls().front().fn, data, n, seed); }

uint32_t crc32c_software(const void* data, size_t n, uint32_t seed) { return run(update_software, data, n, seed); }

bool crc32c_hardware_available() { return impls().front().fn != update_software; }

std::vector<std::string> crc32c_implementations() {
  std::vector<std::string> names;
  for (const Impl& i : impls()) names.emplace_back(i.name);
  return names;
}

uint32_t crc32c_using(const std::string& name, const void* data, size_t n, uint32_t seed) {
  for (const Impl& i : impls())
    if (name == i.name) return run(i.fn, data, n, seed);
  throw std::invalid_argument("CRC32C implementation '" + name + "' is not available on this CPU");
}

}  // namespace dcpds
