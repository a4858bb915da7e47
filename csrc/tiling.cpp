#include "tiling.h"

#include <algorithm>
#include <numeric>

namespace dcpds {
namespace {

// Whether chunks a and b (value positions pa, pb) overlap on all of `nd` dimensions.
bool overlap(In off, In size, size_t pa, size_t pb, int64_t nd) {
  for (int64_t d = 0; d < nd; ++d) {
    const int64_t a0 = off[pa + d], b0 = off[pb + d];
    if (a0 >= b0 + size[pb + d] || b0 >= a0 + size[pa + d]) return false;
  }
  return true;
}

// The dimension along which the chunks start at the most distinct offsets: sweeping along it
// keeps the set of chunks still open small for the shardings DCP produces.
int64_t sweep_dimension(In off, size_t first, int64_t n, int64_t nd, std::vector<int64_t>& scratch) {
  int64_t best = 0;
  size_t most = 0;
  for (int64_t d = 0; d < nd; ++d) {
    scratch.resize(static_cast<size_t>(n));
    for (int64_t q = 0; q < n; ++q) scratch[static_cast<size_t>(q)] = off[first + static_cast<size_t>(q * nd + d)];
    std::sort(scratch.begin(), scratch.end());
    const size_t distinct = static_cast<size_t>(std::unique(scratch.begin(), scratch.end()) - scratch.begin());
    if (distinct > most) most = distinct, best = d;
  }
  return best;
}

// Whether any two of the tensor's n chunks overlap: a sweep along one dimension, each chunk
// tested against the chunks that are still open (end past its start) there.
bool any_overlap(In off, In size, size_t first, int64_t n, int64_t nd, std::vector<int64_t>& scratch) {
  if (n < 2) return false;
  const int64_t s = sweep_dimension(off, first, n, nd, scratch);
  auto pos = [&](int64_t q) { return first + static_cast<size_t>(q * nd); };
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t oa = off[pos(a) + s], ob = off[pos(b) + s];
    return oa != ob ? oa < ob : a < b;
  });
  std::vector<int64_t> open;
  for (const int64_t q : order) {
    const int64_t start = off[pos(q) + s];
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](int64_t o) { return off[pos(o) + s] + size[pos(o) + s] <= start; }),
               open.end());
    for (const int64_t o : open)
      if (overlap(off, size, pos(q), pos(o), nd)) return true;
    open.push_back(q);
  }
  return false;
}

}  // namespace

std::vector<int64_t> find_bad_tilings(In counts, In ndims, In dims, In offsets, In sizes, bool check_covered) {
  std::vector<int64_t> bad, scratch;
  size_t value = 0, dim = 0;
  constexpr int64_t kLimit = int64_t{1} << 62;  // offsets + sizes below it never overflow
  for (size_t k = 0; k < counts.size; ++k) {
    const int64_t n = counts[k], nd = ndims[k];
    const size_t first = value;
    value += static_cast<size_t>(n * nd);
    bool ok = true;
    __int128 covered = 0, total = 1;
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t extent = dims[dim + static_cast<size_t>(d)];
      if (extent < 0 || extent >= kLimit) ok = false;
      total = total > kLimit ? total : total * extent;
    }
    for (int64_t q = 0; q < n && ok; ++q) {
      __int128 elements = 1;
      for (int64_t d = 0; d < nd; ++d) {
        const size_t v = first + static_cast<size_t>(q * nd + d);
        const int64_t o = offsets[v], z = sizes[v], limit = dims[dim + static_cast<size_t>(d)];
        if (o < 0 || z < 0 || o >= kLimit || z >= kLimit || o + z > limit) ok = false;
        elements *= z;
        if (elements > kLimit) ok = false;
      }
      covered += elements;
    }
    if (ok && check_covered && covered != total) ok = false;
    if (ok && any_overlap(offsets, sizes, first, n, nd, scratch)) ok = false;
    if (!ok) bad.push_back(static_cast<int64_t>(k));
    dim += static_cast<size_t>(nd);
  }
  return bad;
}

}  // namespace dcpds
