#include "host_cache.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C library headers lack the name
#endif

namespace {

// Bytes per prefault step: the stop flag is checked between steps (a few ms each).
constexpr uintptr_t kPrefaultStep = uintptr_t(8) << 20;

// Stores into one byte of every page of [lo, hi) without changing it: a compare-and-swap of a
// byte with itself is a write to the kernel (the page is faulted in writable), and a copy worker
// storing into the same byte meanwhile wins either way (the swap then fails and writes nothing new).
void touch_pages(uintptr_t lo, uintptr_t hi, uintptr_t page) {
  for (uintptr_t a = lo; a < hi; a = (a / page + 1) * page) {
    char* b = reinterpret_cast<char*>(a);
    char v = __atomic_load_n(b, __ATOMIC_RELAXED);
    __atomic_compare_exchange_n(b, &v, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
}

// Makes the pages of [lo, hi) (lo page aligned, clipped to [first, hi) for touching) resident
// and writable. MADV_POPULATE_WRITE does it in the kernel without touching the bytes; kernels
// without it (EINVAL) get touched pages. False when memory ran out: touching would only wake
// the OOM killer, so the rest of the cache is left to fault in on first use.
bool populate(uintptr_t lo, uintptr_t hi, uintptr_t first, uintptr_t page, bool* use_madvise) {
  if (*use_madvise) {
    if (::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) == 0) return true;
    if (errno == ENOMEM || errno == EFAULT) return false;  // also EHWPOISON, below
    if (errno == EINVAL || errno == EPERM) {
      *use_madvise = false;  // not supported here
    } else if (errno != EINTR && errno != EAGAIN) {
      return false;  // a poisoned page or another failure: leave the rest to first use
    }
  }
  touch_pages(std::max(lo, first), hi, page);  // no madvise, or interrupted (EINTR, EAGAIN)
  return true;
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

void HostCache::prefault_loop(const std::function<bool()>& busy) {
  const long sys_page = ::sysconf(_SC_PAGESIZE);
  const uintptr_t page = sys_page > 0 ? static_cast<uintptr_t>(sys_page) : 4096;
  const uintptr_t first = reinterpret_cast<uintptr_t>(base_);
  const uintptr_t end = first + bytes_;
  // DCP_DATASTATES_PREFAULT=touch: the fallback of kernels without MADV_POPULATE_WRITE (tests).
  const char* mode = std::getenv("DCP_DATASTATES_PREFAULT");
  bool use_madvise = !(mode && std::string(mode) == "touch");
  // Steps start on page boundaries (madvise needs that; the first may begin before the buffer)
  // and go from the end of the buffer down: copies take slots from its start, so a first
  // checkpoint running meanwhile and the prefault fault in different pages instead of queueing
  // on the same ones.
  const uintptr_t start = first - first % page;
  for (uintptr_t k = (end - start + kPrefaultStep - 1) / kPrefaultStep; k-- > 0;) {
    if (!wait_while(busy)) return;
    const uintptr_t lo = start + k * kPrefaultStep;
    const uintptr_t hi = std::min(end, lo + kPrefaultStep);
    if (!populate(lo, hi, first, page, &use_madvise)) return;
    prefaulted_.fetch_add(hi - std::max(lo, first), std::memory_order_relaxed);
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
