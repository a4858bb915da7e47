// Laying a chunk out in its host-cache slot, shared by the host copy workers (memcpy) and the
// device stager (cudaMemcpyAsync): gaps between pieces are zero-filled, pieces go in file order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "write_job.h"

namespace dcpds {

// Copies nbytes of host memory from src to dst.
inline void copy_bytes(void* dst, const void* src, size_t nbytes) {
  if (nbytes) std::memcpy(dst, src, nbytes);
}

// Lays chunk `c` out in the slot at `base`: zero-fills the gaps between pieces and calls
// copy(slot_dst, piece) for each piece in file order; stops early when copy returns false.
template <typename Copy>
bool place_pieces(char* base, const Chunk& c, const std::vector<Piece>& pieces, Copy copy) {
  uint64_t pos = c.file_off;
  for (size_t i = c.piece_begin; i < c.piece_end; ++i) {
    const Piece& p = pieces[i];
    if (p.file_off > pos) std::memset(base + (pos - c.file_off), 0, p.file_off - pos);
    if (!copy(base + (p.file_off - c.file_off), p)) return false;
    pos = p.file_off + p.len;
  }
  return true;
}

}  // namespace dcpds
