#include "fault.h"

#include <stdexcept>

namespace dcpds {

FaultKind parse_fault_kind(const std::string& name) {
  if (name == "none") return FaultKind::kNone;
  if (name == "eio") return FaultKind::kEio;
  if (name == "enospc") return FaultKind::kEnospc;
  if (name == "short_write") return FaultKind::kShortWrite;
  if (name == "fsync_eio") return FaultKind::kFsyncEio;
  if (name == "stall") return FaultKind::kStall;
  if (name == "direct_einval") return FaultKind::kDirectEinval;
  throw std::invalid_argument("unknown fault kind '" + name +
                              "' (expected none, eio, enospc, short_write, fsync_eio, stall or direct_einval)");
}

void FaultState::set(FaultKind kind, uint64_t after_bytes, std::string path_substring, uint64_t flushed_total) {
  std::lock_guard<std::mutex> g(mu_);
  kind_ = kind;
  trigger_at_ = flushed_total + after_bytes;
  substring_ = std::move(path_substring);
}

FaultKind FaultState::active_for(const std::string& path, uint64_t flushed_total) const {
  std::lock_guard<std::mutex> g(mu_);
  if (kind_ == FaultKind::kNone || flushed_total < trigger_at_) return FaultKind::kNone;
  if (!substring_.empty() && path.find(substring_) == std::string::npos) return FaultKind::kNone;
  return kind_;
}

}  // namespace dcpds
