// Reads of memory that its owner may free while the engine reads it: the sources of a lazy save.
//
// A tensor of the state whose storage is resized or freed before its copy ends (memory-saving
// code does `untyped_storage().resize_(0)`), or an mmap'ed file truncated under a tensor, leaves
// the engine reading pages that are gone: SIGSEGV (unmapped) or SIGBUS (past the file's end),
// which would kill the process. Inside read_guarded, such a fault on the guarded range ends the
// read instead and read_guarded returns false (the caller fails the job with a message). Faults
// anywhere else go on to the handler installed before ours (Python's faulthandler, the default
// action): they end the process as they would have without this module.
//
// Memory that was freed but stays mapped reads without a fault; the Python side's seal check
// (save/pipeline.py VersionGuard.first_freed) fails the save in that case.
#pragma once

#include <csetjmp>
#include <cstddef>
#include <cstdint>

namespace dcpds {

struct GuardedRead {
  sigjmp_buf jump;
  uintptr_t lo = 0;
  uintptr_t hi = 0;
};

// The guarded read in progress on this thread (nullptr: none), for the signal handler.
GuardedRead* volatile& current_guarded_read();

// Installs the SIGSEGV / SIGBUS handler once per process (later calls do nothing).
void install_fault_guard();

// Runs read() (which must only read [src, src + n) and write memory of the caller's own); false
// when it faulted on that range: whatever it wrote is partial.
template <typename Read>
bool read_guarded(const void* src, size_t n, Read&& read) {
  GuardedRead g;
  g.lo = reinterpret_cast<uintptr_t>(src);
  g.hi = g.lo + n;
  GuardedRead* volatile& slot = current_guarded_read();
  // savemask 0: the handler runs with SA_NODEFER, so the jump leaves no signal blocked.
  if (sigsetjmp(g.jump, 0) != 0) {
    slot = nullptr;
    return false;
  }
  slot = &g;
  read();
  slot = nullptr;
  return true;
}

}  // namespace dcpds
