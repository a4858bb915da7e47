#include "host_cache.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include <unistd.h>

namespace {

// Bytes per prefault step: the stop flag is checked between steps (a few ms each).
constexpr uintptr_t kPrefaultStep = uintptr_t(8) << 20;

// Writes one byte of every page of [lo, hi) without changing any: a compare-and-swap of 0 with 0
// is a write access (one write fault maps a fresh page, whose bytes are 0), and a byte a copy
// worker has set is not 0 and is left alone (its page is resident already).
void touch_pages(uintptr_t lo, uintptr_t hi, uintptr_t page) {
  for (uintptr_t a = lo; a < hi; a = (a / page + 1) * page) {
    char zero = 0;
    __atomic_compare_exchange_n(reinterpret_cast<char*>(a), &zero, char(0), false, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
  }
}

}  // namespace

namespace dcpds {

HostCache::HostCache(uint64_t cache_bytes, uint64_t slot_bytes, uint64_t alignment)
    : bytes_(cache_bytes), slot_bytes_(slot_bytes), alignment_(alignment) {
  if (slot_bytes == 0 || slot_bytes > cache_bytes) throw std::invalid_argument("host cache: bad slot size");
  uint64_t nslots = cache_bytes / slot_bytes;
  if (nslots > static_cast<uint64_t>(INT32_MAX))
    throw std::invalid_argument("host cache: " + std::to_string(nslots) + " slots is too many; use a larger chunk");
  slots_total_ = static_cast<int>(nslots);

  // posix_memalign needs a power of two that is a multiple of sizeof(void*).
  size_t align = alignment < sizeof(void*) ? sizeof(void*) : static_cast<size_t>(alignment);
  void* p = nullptr;
  int rc = posix_memalign(&p, align, static_cast<size_t>(cache_bytes));
  if (rc != 0 || p == nullptr)
    throw HostAllocError("cannot allocate the host cache: posix_memalign of " + std::to_string(cache_bytes) +
                         " bytes aligned to " + std::to_string(align) + " failed");
  base_ = static_cast<char*>(p);

  free_.reserve(slots_total_);
  for (int i = slots_total_ - 1; i >= 0; --i) free_.push_back(i);  // slot 0 handed out first
}

HostCache::~HostCache() {
  stop_prefault();
  unpin();
  std::free(base_);
}

std::string HostCache::pin(const CudaApi& api) {
  if (pinned_by_) return "";
  // Portable: pinned for every CUDA context of the process, whichever device copies into it.
  cudaError err = api.HostRegister(base_, static_cast<size_t>(bytes_), kCudaHostRegisterPortable);
  if (err != kCudaSuccess)
    return "cudaHostRegister of " + std::to_string(bytes_) + " bytes failed: " + api.error_text(err);
  pinned_by_ = &api;
  return "";
}

void HostCache::unpin() {
  if (!pinned_by_) return;
  pinned_by_->HostUnregister(base_);
  pinned_by_ = nullptr;
}

void HostCache::start_prefault(std::function<bool()> busy) {
  if (prefault_thread_.joinable() || stop_prefault_.load()) return;
  if (pinned()) {  // cudaHostRegister locked every page in already
    prefaulted_.store(bytes_, std::memory_order_relaxed);
    return;
  }
  try {
    prefault_thread_ = std::thread([this, busy = std::move(busy)] { prefault_loop(busy); });
  } catch (const std::system_error&) {
    // No thread to spare: pages fault in on first use, as without prefaulting.
  }
}

void HostCache::stop_prefault() {
  stop_prefault_.store(true, std::memory_order_relaxed);
  if (prefault_thread_.joinable()) prefault_thread_.join();
}

// False once stopped; polls `busy` every millisecond while it says true.
bool HostCache::wait_while(const std::function<bool()>& busy) {
  while (busy && busy()) {
    if (stop_prefault_.load(std::memory_order_relaxed)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return !stop_prefault_.load(std::memory_order_relaxed);
}

// Touches rather than madvise(MADV_POPULATE_WRITE): that holds the process's mmap lock for a
// whole step, so every mmap/munmap of the training thread (Python and torch allocations) waited
// for it, which made the first checkpoint's call 1.5-5x slower here; page faults take only the
// cache's own VMA lock.
void HostCache::prefault_loop(const std::function<bool()>& busy) {
  const long sys_page = ::sysconf(_SC_PAGESIZE);
  const uintptr_t page = sys_page > 0 ? static_cast<uintptr_t>(sys_page) : 4096;
  const uintptr_t first = reinterpret_cast<uintptr_t>(base_);
  const uintptr_t end = first + bytes_;
  // From the end of the buffer down, in steps: copies take slots from its start, and the stop
  // flag and `busy` are checked between steps.
  for (uintptr_t hi = end; hi > first;) {
    if (!wait_while(busy)) return;
    const uintptr_t lo = hi - first > kPrefaultStep ? hi - kPrefaultStep : first;
    touch_pages(lo, hi, page);
    prefaulted_.fetch_add(hi - lo, std::memory_order_relaxed);
    hi = lo;
  }
}

int HostCache::acquire(double timeout_s, bool* waited) {
  std::unique_lock<std::mutex> lk(mu_);
  *waited = free_.empty();
  if (free_.empty()) {
    auto ready = [this] { return !free_.empty(); };
    if (timeout_s < 0 || timeout_s > 1e9) {
      cv_.wait(lk, ready);
    } else {
      auto deadline = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(timeout_s));
      if (!cv_.wait_until(lk, deadline, ready)) return -1;
    }
  }
  int slot = free_.back();
  free_.pop_back();
  int used = slots_total_ - static_cast<int>(free_.size());
  if (used > peak_used_) peak_used_ = used;
  return slot;
}

void HostCache::release(int slot) {
  {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(slot);
  }
  cv_.notify_one();
}

int HostCache::slots_free() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int>(free_.size());
}

int HostCache::peak_used() const {
  std::lock_guard<std::mutex> g(mu_);
  return peak_used_;
}

}  // namespace dcpds
