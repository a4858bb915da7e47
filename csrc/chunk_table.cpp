#include "chunk_table.h"

#include <algorithm>
#include <initializer_list>
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

// A column of items T read without a type test per read: the check's loops run over millions of
// chunks, and a test per read would cost them more than the check itself.
template <class T>
struct Typed {
  const T* data;
  explicit Typed(const In& c) : data(static_cast<const T*>(c.data)) {}
  int64_t operator[](size_t i) const { return data[i]; }
};

// Whether the non-empty columns of `cols` all have one type, 'i' or 'q'.
bool alike(std::initializer_list<const In*> cols) {
  char type = 0;
  for (const In* c : cols) {
    if (c->size == 0) continue;
    if ((c->type != 'i' && c->type != 'q') || (type != 0 && c->type != type)) return false;
    type = c->type;
  }
  return true;
}

// The type of the first non-empty column ('q' when all are empty).
char type_of(std::initializer_list<const In*> cols) {
  for (const In* c : cols)
    if (c->size > 0) return c->type;
  return 'q';
}

template <class G, class C>
bool check_typed(const ChunkTable& t, Out crc_starts, Out sorted0, Out widest0, TableError* error);

}  // namespace

bool typed_alike(const ChunkTable& t) {
  return alike({&t.offsets, &t.sizes}) && alike({&t.file, &t.offset, &t.length, &t.crc_count});
}

bool check_chunk_table(const ChunkTable& t, Out crc_starts, Out sorted0, Out widest0, TableError* error) {
  const bool grid32 = type_of({&t.offsets, &t.sizes}) == 'i';
  const bool chunks32 = type_of({&t.file, &t.offset, &t.length, &t.crc_count}) == 'i';
  if (grid32)
    return chunks32 ? check_typed<int32_t, int32_t>(t, crc_starts, sorted0, widest0, error)
                    : check_typed<int32_t, int64_t>(t, crc_starts, sorted0, widest0, error);
  return chunks32 ? check_typed<int64_t, int32_t>(t, crc_starts, sorted0, widest0, error)
                  : check_typed<int64_t, int64_t>(t, crc_starts, sorted0, widest0, error);
}

namespace {

template <class G, class C>
bool check_typed(const ChunkTable& t, Out crc_starts, Out sorted0, Out widest0, TableError* error) {
  const Typed<G> offsets(t.offsets), sizes(t.sizes);
  const Typed<C> file(t.file), offset(t.offset), length(t.length), crc_count(t.crc_count);
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
        if (offsets[v] < 0 || sizes[v] < 0) return fail(error, "negative", k, q, d);
      }
  }
  for (size_t k = 0; k < T; ++k) {
    const int64_t n = t.counts[k];
    for (int64_t d = 0; d < t.ndims[k]; ++d) {
      const int64_t limit = t.dims[dstart[k] + d];
      for (int64_t q = 0; q < n; ++q) {
        const size_t v = vstart[k] + static_cast<size_t>(d * n + q);
        if (offsets[v] > limit || sizes[v] > limit - offsets[v]) return fail(error, "exceeds", k, q, d);
      }
    }
  }
  // Element counts: each chunk's length, then each tensor covered exactly.
  std::vector<int64_t> numel(t.file.size, 1);
  for (size_t k = 0; k < T; ++k) {
    const int64_t n = t.counts[k];
    for (int64_t q = 0; q < n; ++q) {
      int64_t e = 1;
      for (int64_t d = 0; d < t.ndims[k]; ++d) e = mul_sat(e, sizes[vstart[k] + static_cast<size_t>(d * n + q)]);
      const size_t c = cstart[k] + static_cast<size_t>(q);
      numel[c] = e;
      if (length[c] != mul_sat(e, t.itemsizes[k])) return fail(error, "length", k, q);
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
      if (file[c] < 0 || file[c] >= F) return fail(error, "file", k, static_cast<int64_t>(c - cstart[k]));
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c)
      if (offset[c] < t.data_start[static_cast<size_t>(file[c])])
        return fail(error, "before", k, static_cast<int64_t>(c - cstart[k]));
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c) {
      const int64_t size = t.file_size[static_cast<size_t>(file[c])], off = offset[c], len = length[c];
      if (off > size || len < 0 || len > size - off) return fail(error, "outside", k, static_cast<int64_t>(c - cstart[k]));
    }
  int64_t crcs = 0;
  for (size_t k = 0; k < T; ++k)
    for (size_t c = cstart[k]; c < cstart[k + 1]; ++c) {
      const size_t f = static_cast<size_t>(file[c]);
      const int64_t start = t.data_start[f], step = t.piece_size[f], off = offset[c], len = length[c];
      const int64_t pieces = len > 0 && step > 0 ? (off + len - 1 - start) / step - (off - start) / step + 1 : 0;
      if (crc_count[c] != 0 && crc_count[c] != pieces)
        return fail(error, "checksums", k, static_cast<int64_t>(c - cstart[k]), -1, crc_count[c], pieces);
      crc_starts[c] = crcs;
      crcs = add_sat(crcs, crc_count[c] < 0 ? kMax : crc_count[c]);
    }
  crc_starts[t.file.size] = crcs;
  // What a lookup needs: dim-0 offsets in order (a bisection), and the widest dim-0 chunk.
  for (size_t k = 0; k < T; ++k) {
    int64_t sorted = 1, widest = 0;
    if (t.ndims[k] > 0) {
      const int64_t n = t.counts[k];
      for (int64_t q = 0; q < n; ++q) {
        const size_t v = vstart[k] + static_cast<size_t>(q);
        if (q > 0 && offsets[v] < offsets[v - 1]) sorted = 0;
        widest = std::max(widest, sizes[v]);
      }
    }
    sorted0[k] = sorted;
    widest0[k] = widest;
  }
  return true;
}

}  // namespace

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

namespace {

// place_chunks with its table's and its results' offsets read typed (G, O: int32 or int64): the
// loop runs once per result, millions of them, and reads those most.
template <class G, class O>
void place_typed(const std::vector<int64_t>& tensor_keys, const std::vector<int64_t>& counts,
                 const std::vector<int64_t>& ndims, Typed<G> table_offsets, In key, In position, In ndim,
                 Typed<O> offsets, int64_t first, Out src, Out status) {
  const size_t T = tensor_keys.size();
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
    // Chunk q's dim-0 offset.
    auto dim0 = [&](int64_t q) { return table_offsets[static_cast<size_t>(vstart[t] + q)]; };
    char& how = state[static_cast<size_t>(t)];
    std::vector<int64_t>& order = by_dim0[static_cast<size_t>(t)];
    if (how == kUnknown) {
      how = kInOrder;
      for (int64_t q = 1; q < n && how == kInOrder; ++q)
        if (dim0(q) < dim0(q - 1)) how = kSorted;
      if (how == kSorted) {
        order.resize(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return dim0(a) < dim0(b); });
      }
    }
    const int64_t want = offsets[o];
    if (how == kInOrder) {
      // The first chunk whose dim-0 offset is not below `want` (a bisection), then its equals.
      int64_t lo = 0, hi = n;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (dim0(mid) < want) lo = mid + 1; else hi = mid;
      }
      for (int64_t q = lo; q < n && dim0(q) == want; ++q)
        if (same(t, q, o)) return q;
      return -1;
    }
    auto it = std::lower_bound(order.begin(), order.end(), want, [&](int64_t q, int64_t v) { return dim0(q) < v; });
    for (; it != order.end() && dim0(*it) == want; ++it)
      if (same(t, *it, o)) return *it;
    return -1;
  };
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
    src[static_cast<size_t>(row)] = first + static_cast<int64_t>(i);
    status[i] = row;
  }
}

}  // namespace

void place_chunks(In tensor_keys, In counts, In ndims, In table_offsets, In key, In position, In ndim, In offsets,
                  int64_t first, Out src, Out status) {
  // The per-tensor columns, read per result: widened once (a few thousand values).
  std::vector<int64_t> keys(tensor_keys.size), cnt(tensor_keys.size), nd(tensor_keys.size);
  for (size_t k = 0; k < keys.size(); ++k) {
    keys[k] = tensor_keys[k];
    cnt[k] = counts[k];
    nd[k] = ndims[k];
  }
  const bool g32 = table_offsets.type == 'i', o32 = offsets.type == 'i';
  if (g32 && o32)
    place_typed(keys, cnt, nd, Typed<int32_t>(table_offsets), key, position, ndim, Typed<int32_t>(offsets), first, src, status);
  else if (g32)
    place_typed(keys, cnt, nd, Typed<int32_t>(table_offsets), key, position, ndim, Typed<int64_t>(offsets), first, src, status);
  else if (o32)
    place_typed(keys, cnt, nd, Typed<int64_t>(table_offsets), key, position, ndim, Typed<int32_t>(offsets), first, src, status);
  else
    place_typed(keys, cnt, nd, Typed<int64_t>(table_offsets), key, position, ndim, Typed<int64_t>(offsets), first, src, status);
}

void gather_pieces(In src, In first, In crcs, Column<uint32_t> out) {
  size_t at = 0;
  for (size_t r = 0; r < src.size; ++r) {
    const size_t i = static_cast<size_t>(src[r]);
    for (auto c = static_cast<size_t>(first[i]), end = static_cast<size_t>(first[i + 1]); c < end; ++c)
      out[at++] = static_cast<uint32_t>(crcs[c]);
  }
}

}  // namespace dcpds
