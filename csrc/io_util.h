// Small POSIX I/O helpers: full-length pwrite/pread loops and errno text for error messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fault.h"

namespace dcpds {

// "No space left on device (errno 28)"; thread-safe (strerror_r).
std::string errno_text(int err);

// Writes all n bytes of buf at file offset off, retrying partial writes and EINTR.
// Returns "" on success, otherwise a message like
// "pwrite of 1048576 bytes at offset 4096 failed: No space left on device (errno 28)".
// `fault` simulates the failure of that name (kEio, kEnospc, kShortWrite, kDirectEinval: the
// caller passes it for O_DIRECT writes only); others are ignored here (kStall holds the flush
// before it gets here, see Engine::flush_chunk). `errnum`, when given, gets the errno of a failed
// write (0 otherwise, and for a short write).
std::string pwrite_full(int fd, const void* buf, size_t n, uint64_t off, FaultKind fault = FaultKind::kNone,
                        int* errnum = nullptr);

// Reads up to n bytes at off into buf, retrying partial reads and EINTR, stopping at EOF.
// Returns 0 and sets *got (< n only at end of file), or returns the errno of a failed pread.
int pread_full(int fd, void* buf, size_t n, uint64_t off, size_t* got);

// Opens a checkpoint file for reading: never through a symlink (O_NOFOLLOW), never blocking on
// a FIFO (O_NONBLOCK), and only a regular file. Returns the descriptor, or -1 with *err set to
// a message naming the path ("...: is a FIFO, not a regular file") and *errnum to the errno.
int open_regular_for_read(const std::string& path, std::string* err, int* errnum);

// Creates (or truncates) a data file for writing, the same way: no symlink followed, no FIFO
// waited on, only a regular file, and never one with other hard links (truncating it would
// change another checkpoint that shares the inode). -1 with *err on failure.
int open_regular_for_write(const std::string& path, std::string* err);

// Opens the file `fd` refers to again, for writes that bypass the page cache (Linux O_DIRECT,
// through /proc/self/fd: the same inode, never a path looked up again). -1 where the file system
// or the platform refuses it; the caller then writes through `fd`.
int reopen_for_direct_io(int fd);

// O_DIRECT's alignment of memory, file offset and length: the page size, a multiple of every
// block device's logical block size.
constexpr uint64_t kDirectIoAlign = 4096;

// Starts the disk write of [off, off + len) of fd, just written, without waiting (Linux
// sync_file_range; a no-op elsewhere): a hint, errors ignored, the final fsync reports real ones.
void start_writeback(int fd, uint64_t off, uint64_t len);

// True when `path`, or while it does not exist its nearest existing ancestor, is on a
// memory-backed file system (Linux tmpfs or ramfs, by statfs's f_type); false elsewhere and when
// nothing on the way can be examined.
bool memory_backed(const std::string& path);

}  // namespace dcpds
