// One aligned host buffer, allocated once, carved into equal slots that copy workers borrow and
// flush workers return in any order. Acquire blocks when all slots are out (backpressure).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"

namespace dcpds {

// std::bad_alloc carrying a message (pybind11 maps it to MemoryError with that text).
class HostAllocError : public std::bad_alloc {
 public:
  explicit HostAllocError(std::string msg) : msg_(std::move(msg)) {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

class HostCache {
 public:
  // Maps `cache_bytes` aligned to `alignment` (a power of two), left out of forked children
  // (MADV_DONTFORK), and splits it into cache_bytes / slot_bytes slots. Throws HostAllocError if
  // the mapping fails.
  HostCache(uint64_t cache_bytes, uint64_t slot_bytes, uint64_t alignment);
  ~HostCache();
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  // Borrows a free slot, waiting up to timeout_s seconds (negative: forever). Returns the slot
  // index, or -1 on timeout. *waited is set when no slot was free on entry.
  int acquire(double timeout_s, bool* waited);
  // Returns a slot; any slot may be returned at any time, in any order.
  void release(int slot);

  char* slot_ptr(int slot) const { return base_ + static_cast<uint64_t>(slot) * slot_bytes_; }
  char* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t alignment() const { return alignment_; }
  int slots_total() const { return slots_total_; }
  int slots_free() const;
  int peak_used() const;
  // The buffer is never reallocated; reported so tests can check the promise.
  uint64_t allocations() const { return 1; }

  // Page-locks the whole buffer with cudaHostRegister so device-to-host copies into it run at
  // full speed and asynchronously. Returns "" on success, else why it is not pinned (the cache
  // works unpinned). Not thread-safe against unpin; the engine calls both from its lifecycle.
  std::string pin(const CudaApi& api);
  // Undoes pin (no-op when not pinned). Every copy into the buffer must be complete.
  void unpin();
  bool pinned() const { return pinned_by_ != nullptr; }

  // Makes every page of the buffer resident and writable on a background thread, once, so the
  // first checkpoint pays no page faults and RSS is the whole cache from the start (flat). It
  // touches a slot only while holding it (a copy may wait that long for the last free slot).
  // Call after pin(): a pinned buffer is resident already and is only counted as done. `busy` is asked between
  // steps: while it says true (copies are running), the thread waits instead of taking CPU and
  // page-table locks from them; they fault in what they touch themselves.
  void start_prefault(std::function<bool()> busy = nullptr);
  // Stops the prefault thread between two steps (a few ms) and joins it. Idempotent.
  void stop_prefault();
  // Bytes made resident so far (the whole buffer once done, or at once when pinned).
  uint64_t prefaulted_bytes() const { return prefaulted_.load(std::memory_order_relaxed); }

 private:
  void prefault_loop(const std::function<bool()>& busy);
  bool take_for_prefault(int slot);  // takes `slot` off the free list if it is there
  void give_back_prefault(int slot);
  bool wait_while(const std::function<bool()>& busy);


  char* map_ = nullptr;  // the mapping (base_ is map_ aligned up)
  uint64_t map_bytes_ = 0;
  char* base_ = nullptr;
  uint64_t bytes_;
  uint64_t slot_bytes_;
  uint64_t alignment_;
  int slots_total_;
  const CudaApi* pinned_by_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;  // LIFO: the most recently written slot is the warmest in CPU caches
  int prefault_slot_ = -1;  // the free slot the prefault thread is touching, off the list meanwhile
  int peak_used_ = 0;

  std::thread prefault_thread_;
  std::atomic<bool> stop_prefault_{false};
  std::atomic<uint64_t> prefaulted_{0};
};

}  // namespace dcpds
