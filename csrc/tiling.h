// Whether a tensor's chunks tile it, as DCP's global-plan validation asks of a save: every chunk
// inside the tensor, no two chunks sharing an element, and (on request) the chunks' elements
// adding up to the tensor's. For dcp_datastates/save/global_plan.py, which hands the tensors
// this names to DCP's own validation for its messages.
#pragma once

#include <cstdint>
#include <vector>

#include "chunk_table.h"

namespace dcpds {

// Per tensor (T): its number of chunks, its number of dimensions, and (`dims`, tensor by tensor)
// its size. Per value, chunk by chunk (each chunk's ndims offsets, then the next chunk's):
// `offsets` and `sizes`. Two chunks overlap as DCP tests it: on every dimension each starts
// before the other ends. Returns the indices of the tensors that fail, in order; a count that
// overflows int64 fails the tensor (the caller's exact check decides).
std::vector<int64_t> find_bad_tilings(In counts, In ndims, In dims, In offsets, In sizes, bool check_covered);

}  // namespace dcpds
