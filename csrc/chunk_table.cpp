#include "chunk_table.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <vector>

namespace dcpds {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// a * b, saturated at kMax (both non-negative).
int64_t mul_sat(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_mul_overflow(a, b, &out) ? kMax : out;
}

int64_t add_sat(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_add_overflow(a, b, &out) ? kMax : out;
}

bool fail(TableError* e, const char* kind, int64_t tensor, int64_t chunk, int64_t dim = -1, int64_t a = 0, int64_t b = 0) {
  e->kind = kind;
  e->tensor = tensor;
  e->chunk = chunk;
  e->dim = dim;
  e->a = a;
  e->b = b;
  return false;
}

}  // namespace

bool check_chunk_table(const ChunkTable& t, Out crc_starts, Out sorted0, Out widest0, TableError* error) {
  const size_t T = t.counts.size;
  // Each tensor's first value (in offsets/sizes), first chunk and first dimension.
  std::vector<size_t> vstart(T + 1, 0), cstart(T + 1, 0), dstart(T + 1, 0);
  for (size_t k = 0; k < T; ++k) {
    vstart[k + 1] = vstart[k] + static_cast<size_t>(t.counts[k] * t.ndims[k]);
    cstart[k + 1] = cstart[k] + static_cast<size_t>(t.counts[k]);
    dstart[k + 1] = dstart[k] + static_cast<size_t>(t.ndims[k]);
  }
  // Chunks inside their tensor: first no negative value anywhere, then none past the size.
  for (size_t k = 0; k < T; ++k) {
    const int64_t n = t.counts[k];
    for (int64_t d = 0; d < t.ndims[k]; ++d)
      for (int64_t q = 0; q < n; ++q) {
        const size_t v = vstart[k] + static_cast<size_t>(d * n + q);
        if (t.offsets[v] < 0 || t.sizes[v] < 0) return fail(error, "negative", k, q, d);
      }
  }
  for (size_t k = 0; k < T; ++k) {
    const int64_t n = t.counts[k];
    for (int64_t d = 0; d < t.ndims[k]; ++d) {
      const int64_t limit = t.dims[dstart[k] + d];
      for (int64_t q = 0; q < n; ++q) {
        const size_t v = vstart[k] + static_cast<size_t>(d * n + q);
        if (t.offsets[v] > limit || t.sizes[v] > limit - t.offsets[v]) return fail(error, "exceeds", k, q, d);
      }
    }
  }
  // Element counts: each chunk's length, then each tensor covered exactly.
  std::vector<int64_t> numel(t.file.size, 1);
  for (size_t k = 0; k < T; ++k) {
    const int64_t n = t.counts[k];
    for (int64_t q = 0; q < n; ++q) {
      int64_t e = 1;
      for (int64_t d = 0; d < t.ndims[k]; ++d) e = mul_sat(e, t.sizes[vstart[k] + static_cast<size_t>(d * n + q)]);
      const size_t c = cstart[k] + static_cast<size_t>(q);
      numel[c] = e;
      if (t.length[c] != mul_sat(e, t.itemsizes[k])) return fail(error, "length", k, q);
    }
  }
  for (size_t k = 0; k < T; ++k) {
    int64_t covered = 0, total = 1;
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c) covered = add_sat(covered, numel[c]);
    for (size_t d = dstart[k]; d < dstart[k + 1]; ++d) total = mul_sat(total, t.dims[d]);
    if (covered != total || total == kMax) return fail(error, "covered", k, -1, -1, covered, total);
  }
  // Byte ranges inside their file's data region, one checksum per piece of the grid.
  const int64_t F = static_cast<int64_t>(t.file_size.size);
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c)
      if (t.file[c] < 0 || t.file[c] >= F) return fail(error, "file", k, static_cast<int64_t>(c - cstart[k]));
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c)
      if (t.offset[c] < t.data_start[static_cast<size_t>(t.file[c])])
        return fail(error, "before", k, static_cast<int64_t>(c - cstart[k]));
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c) {
      const int64_t size = t.file_size[static_cast<size_t>(t.file[c])], off = t.offset[c], len = t.length[c];
      if (off > size || len < 0 || len > size - off) return fail(error, "outside", k, static_cast<int64_t>(c - cstart[k]));
    }
  int64_t crcs = 0;
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c) {
      const size_t f = static_cast<size_t>(t.file[c]);
      const int64_t start = t.data_start[f], step = t.piece_size[f], off = t.offset[c], len = t.length[c];
      const int64_t pieces = len > 0 && step > 0 ? (off + len - 1 - start) / step - (off - start) / step + 1 : 0;
      if (t.crc_count[c] != 0 && t.crc_count[c] != pieces)
        return fail(error, "checksums", k, static_cast<int64_t>(c - cstart[k]), -1, t.crc_count[c], pieces);
      crc_starts[c] = crcs;
      crcs = add_sat(crcs, t.crc_count[c] < 0 ? kMax : t.crc_count[c]);
    }
  crc_starts[t.file.size] = crcs;
  // What a lookup needs: dim-0 offsets in order (a bisection), and the widest dim-0 chunk.
  for (size_t k = 0; k < T; ++k) {
    int64_t sorted = 1, widest = 0;
    if (t.ndims[k] > 0) {
      const int64_t n = t.counts[k];
      for (int64_t q = 0; q < n; ++q) {
        const size_t v = vstart[k] + static_cast<size_t>(q);
        if (q > 0 && t.offsets[v] < t.offsets[v - 1]) sorted = 0;
        widest = std::max(widest, t.sizes[v]);
      }
    }
    sorted0[k] = sorted;
    widest0[k] = widest;
  }
  return true;
}

bool find_shared_bytes(In fid, In start, In length, int64_t files, size_t ordered, int64_t* first, int64_t* second) {
  const size_t n = fid.size, F = static_cast<size_t>(std::max<int64_t>(files, 0));
  ordered = std::min(ordered, n);
  // Each file's leading items that come in increasing order, one after the other, share no byte
  // (a writer lays a rank's items out in about the order the table lists them). The others (an
  // item the table lists late, the values after the chunks) are checked against those by a
  // bisection, and against each other; only a file where one may overlap is sorted below.
  std::vector<int64_t> end(F, std::numeric_limits<int64_t>::min());
  std::vector<char> aside(n, 0), unordered(F, 0), has_aside(F, 0);
  std::vector<int64_t> extras;
  for (size_t i = 0; i < n; ++i) {
    if (length[i] <= 0) continue;
    const size_t f = static_cast<size_t>(fid[i]);
    if (i < ordered && start[i] >= end[f]) {
      end[f] = start[i] + length[i];
    } else {
      aside[i] = 1;
      has_aside[f] = 1;
      extras.push_back(static_cast<int64_t>(i));
    }
  }
  if (!extras.empty()) {
    // The set-aside items sorted by (file, start); against each other: neighbours only.
    std::sort(extras.begin(), extras.end(), [&](int64_t a, int64_t b) {
      return fid[a] != fid[b] ? fid[a] < fid[b] : start[a] < start[b];
    });
    std::vector<size_t> next(F + 1, extras.size());
    for (size_t k = extras.size(); k-- > 0;) next[static_cast<size_t>(fid[extras[k]])] = k;
    for (size_t k = 1; k < extras.size(); ++k) {
      const int64_t a = extras[k - 1], b = extras[k];
      if (fid[a] == fid[b] && start[b] < start[a] + length[a]) unordered[static_cast<size_t>(fid[a])] = 1;
    }
    // Against the file's items in order: each set-aside item meets only the item before it and
    // the item after it there (a merge of two sorted runs, per file).
    std::fill(end.begin(), end.end(), std::numeric_limits<int64_t>::min());
    auto settle = [&](size_t f, int64_t upto) {  // the set-aside items of f starting before upto
      while (next[f] < extras.size() && static_cast<size_t>(fid[extras[next[f]]]) == f &&
             start[extras[next[f]]] < upto) {
        const int64_t b = extras[next[f]++];
        if (end[f] > start[b] || (upto != std::numeric_limits<int64_t>::max() && upto < start[b] + length[b]))
          unordered[f] = 1;
      }
    };
    for (size_t i = 0; i < n; ++i) {
      const size_t f = static_cast<size_t>(fid[i]);
      if (length[i] <= 0 || aside[i] || !has_aside[f]) continue;
      settle(f, start[i]);
      end[f] = start[i] + length[i];
    }
    for (size_t f = 0; f < F; ++f)
      if (has_aside[f]) settle(f, std::numeric_limits<int64_t>::max());
  }
  std::vector<int64_t> order;
  for (size_t i = 0; i < n; ++i)
    if (length[i] > 0 && unordered[static_cast<size_t>(fid[i])]) order.push_back(static_cast<int64_t>(i));
  if (order.empty()) return false;
  // Sorted by (file, start), each item must begin at or after the end of the one before it in
  // its file: then the ends increase too, and no item reaches into any earlier one.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return fid[a] != fid[b] ? fid[a] < fid[b] : start[a] < start[b];
  });
  for (size_t j = 1; j < order.size(); ++j) {
    const int64_t a = order[j - 1], b = order[j];
    if (fid[a] == fid[b] && start[b] < start[a] + length[a]) {
      *first = a;
      *second = b;
      return true;
    }
  }
  return false;
}

void place_chunks(In tensor_keys, In counts, In ndims, In table_offsets, In key, In position, In ndim, In offsets,
                  Out src, Out status) {
  const size_t T = tensor_keys.size;
  std::vector<int64_t> vstart(T + 1, 0), cstart(T + 1, 0);
  std::unordered_map<int64_t, int64_t> tensor_of;
  tensor_of.reserve(T * 2);
  for (size_t k = 0; k < T; ++k) {
    vstart[k + 1] = vstart[k] + counts[k] * ndims[k];
    cstart[k + 1] = cstart[k] + counts[k];
    tensor_of.emplace(tensor_keys[k], static_cast<int64_t>(k));
  }
  // Chunk `q` of tensor `t` has the offsets at offsets[o...]?
  auto same = [&](int64_t t, int64_t q, size_t o) {
    const int64_t n = counts[t];
    for (int64_t d = 0; d < ndims[t]; ++d)
      if (table_offsets[static_cast<size_t>(vstart[t] + d * n + q)] != offsets[o + static_cast<size_t>(d)]) return false;
    return true;
  };
  // Per tensor, made when a hint first misses: its positions by dim-0 offset (stable), unless
  // they are in that order already (DCP's shardings list them so): then none is needed.
  enum : char { kUnknown, kInOrder, kSorted };
  std::vector<char> state(T, kUnknown);
  std::vector<std::vector<int64_t>> by_dim0(T);
  auto look_up = [&](int64_t t, size_t o) -> int64_t {
    const int64_t n = counts[t];
    if (ndims[t] == 0) return n > 0 ? 0 : -1;
    const int64_t* first = table_offsets.data + vstart[t];
    char& how = state[static_cast<size_t>(t)];
    if (how == kUnknown) {
      how = std::is_sorted(first, first + n) ? kInOrder : kSorted;
      if (how == kSorted) {
        std::vector<int64_t>& order = by_dim0[static_cast<size_t>(t)];
        order.resize(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first[a] < first[b]; });
      }
    }
    const int64_t want = offsets[o];
    if (how == kInOrder) {
      for (const int64_t* q = std::lower_bound(first, first + n, want); q != first + n && *q == want; ++q)
        if (same(t, q - first, o)) return q - first;
      return -1;
    }
    const std::vector<int64_t>& order = by_dim0[static_cast<size_t>(t)];
    auto it = std::lower_bound(order.begin(), order.end(), want, [&](int64_t q, int64_t v) { return first[q] < v; });
    for (; it != order.end() && first[*it] == want; ++it)
      if (same(t, *it, o)) return *it;
    return -1;
  };
  for (size_t r = 0; r < src.size; ++r) src[r] = -1;
  size_t o = 0;
  int64_t last = -1;
  for (size_t i = 0; i < key.size; o += static_cast<size_t>(ndim[i]), ++i) {
    // A rank's results follow the tensors' order: try the tensor after the last one first.
    int64_t t = last + 1;
    if (t >= static_cast<int64_t>(T) || tensor_keys[static_cast<size_t>(t)] != key[i]) {
      const auto found = tensor_of.find(key[i]);
      if (found == tensor_of.end()) {
        status[i] = -1;
        continue;
      }
      t = found->second;
    }
    last = t;
    const int64_t n = counts[t];
    int64_t p = position[i];
    if (ndim[i] != ndims[t]) {
      status[i] = -2 - t;
      continue;
    }
    if (!(p >= 0 && p < n && same(t, p, o))) p = look_up(t, o);
    if (p < 0) {
      status[i] = -2 - t;
      continue;
    }
    const int64_t row = cstart[t] + p;
    src[static_cast<size_t>(row)] = static_cast<int64_t>(i);
    status[i] = row;
  }
}

void gather_pieces(In src, In first, In crcs, Out out) {
  size_t at = 0;
  for (size_t r = 0; r < src.size; ++r) {
    const size_t i = static_cast<size_t>(src[r]);
    const int64_t* begin = crcs.data + first[i];
    const int64_t* end = crcs.data + first[i + 1];
    std::copy(begin, end, out.data + at);
    at += static_cast<size_t>(end - begin);
  }
}

}  // namespace dcpds
