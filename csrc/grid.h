// The checksum grid of a data file, stated once for the engine and for Python (bindings expose
// piece_count / piece_ranges; dcp_datastates/checkpoint_format.py calls them): cell k covers
// [data_start + k*step, data_start + (k+1)*step), data_start being the first byte after the
// header. A piece is the part of one item inside one cell; each piece gets its own CRC32C.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcpds {
namespace grid {

inline uint64_t cell_of(uint64_t pos, uint64_t data_start, uint64_t step) { return (pos - data_start) / step; }

inline uint64_t cell_end(uint64_t cell, uint64_t data_start, uint64_t step) { return data_start + (cell + 1) * step; }

// Pieces of the item [offset, offset + nbytes); offset >= data_start and step > 0.
inline size_t piece_count(uint64_t offset, uint64_t nbytes, uint64_t data_start, uint64_t step) {
  if (nbytes == 0) return 0;
  return static_cast<size_t>(cell_of(offset + nbytes - 1, data_start, step) - cell_of(offset, data_start, step) + 1);
}

// Calls f(piece_offset, piece_length) for each piece of the item, in file order.
template <class F>
void for_each_piece(uint64_t offset, uint64_t nbytes, uint64_t data_start, uint64_t step, F&& f) {
  const uint64_t end = offset + nbytes;
  for (uint64_t pos = offset; pos < end;) {
    const uint64_t cell_stop = cell_end(cell_of(pos, data_start, step), data_start, step);
    const uint64_t stop = cell_stop < end ? cell_stop : end;
    f(pos, stop - pos);
    pos = stop;
  }
}

}  // namespace grid
}  // namespace dcpds
