// Fault injection for tests: makes the flush path fail in a chosen way. Off by default.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace dcpds {

// kStall: flushes of matching files wait (writing nothing) until the fault is cleared or their
// job fails: a hung device, or a checkpoint held in flight for as long as a test needs (abort,
// Ctrl-C, cache-full timeouts).
// kDirectEinval: O_DIRECT writes fail with EINVAL, as on a file system that opens files with
// O_DIRECT but refuses the page alignment of the writes; every other write goes through.
enum class FaultKind { kNone, kEio, kEnospc, kShortWrite, kFsyncEio, kStall, kDirectEinval };

// Parses "none", "eio", "enospc", "short_write", "fsync_eio", "stall", "direct_einval"; throws
// std::invalid_argument.
FaultKind parse_fault_kind(const std::string& name);

// The fault a write through the page cache sees: kDirectEinval is for O_DIRECT writes only.
inline FaultKind through_page_cache(FaultKind f) { return f == FaultKind::kDirectEinval ? FaultKind::kNone : f; }

class FaultState {
 public:
  // Arms `kind` for files whose path contains path_substring, once flushed_total has grown by
  // after_bytes past its value now. Stays armed until kind == kNone is set.
  void set(FaultKind kind, uint64_t after_bytes, std::string path_substring, uint64_t flushed_total);
  // The fault that applies to a write or fsync of `path` now (kNone almost always).
  FaultKind active_for(const std::string& path, uint64_t flushed_total) const;

 private:
  mutable std::mutex mu_;
  FaultKind kind_ = FaultKind::kNone;
  uint64_t trigger_at_ = 0;
  std::string substring_;
};

}  // namespace dcpds
