// The checks of a packed chunk table (format version 3, dcp_datastates/format/packed.py): what
// the decoder and the commit check for every chunk, in one pass per check over plain arrays.
// Python formats the message of the first failure this reports; it owns nothing else here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dcpds {

template <class T>
struct Column {
  T* data = nullptr;
  size_t size = 0;
  T& operator[](size_t i) const { return data[i]; }
};

// A column read as int64 values whatever its items' width: the caller hands each column in the
// narrowest type that holds it (at scale a 64-bit copy of every column is most of rank 0's
// memory). `type` is the item type as Python's buffer protocol names it: 'q' int64, 'i' int32,
// 'I' uint32 (checksums), 'b' int8. (Tested in that order, most frequent first: a chain of
// well-predicted compares costs the hot loops less than a jump table.)
struct In {
  const void* data = nullptr;
  size_t size = 0;
  char type = 'q';
  int64_t operator[](size_t i) const {
    if (type == 'q') return static_cast<const int64_t*>(data)[i];
    if (type == 'i') return static_cast<const int32_t*>(data)[i];
    if (type == 'I') return static_cast<const uint32_t*>(data)[i];
    return static_cast<const int8_t*>(data)[i];
  }
};
using Out = Column<int64_t>;

// The first failure found, in the order the checks run (each over the whole table):
//   "negative"  a negative chunk offset or size          (tensor, chunk, dim)
//   "exceeds"   a chunk reaching past its tensor's size   (tensor, chunk, dim)
//   "length"    a stored length that is not numel * itemsize (tensor, chunk)
//   "covered"   a tensor's chunks holding a = elements, its size b (tensor)
//   "file"      a file index out of range                 (tensor, chunk)
//   "before"    a byte range starting before its file's data region (tensor, chunk)
//   "outside"   a byte range outside its file             (tensor, chunk)
//   "checksums" a = checksums for b pieces                (tensor, chunk)
struct TableError {
  std::string kind;
  int64_t tensor = -1, chunk = -1, dim = -1, a = 0, b = 0;
};

struct ChunkTable {
  // Per tensor (T): its chunks, dimensions, element size; `dims` its size, tensor by tensor.
  In counts, ndims, itemsizes, dims;
  // Per value (sum of counts * ndims): chunk offsets and sizes, per tensor dimension-major.
  // Both of one item type, int32 or int64 (the hot loops read them typed: see `Typed`).
  In offsets, sizes;
  // Per chunk (sum of counts): file index, byte offset, byte length, number of checksums. All
  // four of one item type, int32 or int64.
  In file, offset, length, crc_count;
  // Per file: size, first data byte, checksum grid step.
  In file_size, data_start, piece_size;
};

// Whether the grid columns (offsets, sizes) share one type of 'i' or 'q', and so do the four
// chunk columns (an empty column takes any type): what check_chunk_table requires.
bool typed_alike(const ChunkTable& t);

// Checks `t` (typed_alike). On success fills crc_starts (chunks + 1: each chunk's first checksum, then the
// total), sorted0 (per tensor: 1 when its chunks' dim-0 offsets never decrease) and widest0 (per
// tensor: its widest dim-0 chunk size) and returns true; otherwise sets `error`. The caller has
// checked the columns' lengths.
bool check_chunk_table(const ChunkTable& t, Out crc_starts, Out sorted0, Out widest0, TableError* error);

// Whether two of the items [start, start + length) of files `fid` share a byte (empty items
// share nothing). When they do, returns true with `first` and `second` the indices of the first
// such pair in (file, start) order. Linear when each file's items mostly come in increasing
// order among the first `ordered` (the rest are checked by bisection); a file where an overlap
// may be is sorted to name the pair.
bool find_shared_bytes(In fid, In start, In length, int64_t files, size_t ordered, int64_t* first, int64_t* second);

// Places every rank's chunk results in the table (format/results.py sends them packed). The
// table: per tensor its name key, chunks and dimensions, and its chunks' offsets (as in
// ChunkTable). Per result: its tensor's key, DCP's position hint (-1: none), its number of
// dimensions and (back to back) its offsets. A result whose key names a tensor goes to the chunk
// its hint points at when that chunk has its offsets, else to the first chunk that has them
// (looked up by dim-0 offset): status = that chunk's row, and src[row] = first + the result's
// index (a later result for one row wins). Otherwise status = -1 (no tensor has the key) or
// -2 - tensor (no chunk of it has the offsets). Other rows of src are left as they are: a caller
// places its results a part at a time (numbering each part's from `first`), src starting at -1.
void place_chunks(In tensor_keys, In counts, In ndims, In table_offsets, In key, In position, In ndim, In offsets,
                  int64_t first, Out src, Out status);

// The placed rows' checksums, in row order: for each row r, the crc_count[src[r]] checksums of
// result src[r] (`crcs` holds every result's back to back, `first` where each result's start,
// with one more entry: the total). `out` holds exactly as many as the rows take. Every src[r] is
// a valid result index. Checksums are 32-bit: `out` holds them as such (at scale, millions of
// them on rank 0). (The rows' other columns are plain index gathers: format/packed_encode.py.)
void gather_pieces(In src, In first, In crcs, Column<uint32_t> out);

}  // namespace dcpds
