#include "host_cache.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <sys/mman.h>
#include <unistd.h>

namespace {

// Bytes per prefault step: the stop flag is checked between steps (a few ms each).
constexpr uintptr_t kPrefaultStep = uintptr_t(8) << 20;

// Writes one byte of every page of [lo, hi): one write fault each maps a fresh page. Only for
// memory no copy can be writing (a slot the prefault thread holds, or the tail past the slots).
void touch_pages(uintptr_t lo, uintptr_t hi, uintptr_t page) {
  for (uintptr_t a = lo; a < hi; a = (a / page + 1) * page) *reinterpret_cast<volatile char*>(a) = 0;
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

  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("host cache: alignment " + std::to_string(alignment) + " is not a power of two");
  // A mapping of its own (not malloc's heap), so that it can be left out of forked children:
  // a child (a DataLoader worker, any os.fork) would otherwise share every page copy-on-write,
  // and each page a copy then writes here would be duplicated for as long as the child lives
  // (the cache's size again in memory, and a page fault per 4 KiB on the copy threads).
  // Nothing in a child may use the parent's cache: its engine is set aside there
  // (runtime/engine.py) and a save in the child starts an engine of its own.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t align = std::max<uint64_t>(alignment, page);
  map_bytes_ = (cache_bytes + page - 1) / page * page + (align - page);
  void* m = ::mmap(nullptr, static_cast<size_t>(map_bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    throw HostAllocError("cannot allocate the host cache: mmap of " + std::to_string(map_bytes_) + " bytes (" +
                         std::to_string(cache_bytes) + " aligned to " + std::to_string(alignment) +
                         ") failed: " + std::strerror(errno));
  map_ = static_cast<char*>(m);
  base_ = map_ + ((align - reinterpret_cast<uintptr_t>(map_) % align) % align);
  ::madvise(map_, static_cast<size_t>(map_bytes_), MADV_DONTFORK);  // best effort: a kernel without it forks as before

  free_.reserve(slots_total_);
  for (int i = slots_total_ - 1; i >= 0; --i) free_.push_back(i);  // slot 0 handed out first
}

HostCache::~HostCache() {
  stop_prefault();
  unpin();
  ::munmap(map_, static_cast<size_t>(map_bytes_));
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
// for it, which made the first checkpoint's call several times slower; page faults take only the
// cache's own VMA lock.
// A slot is touched only while this thread holds it (taken off the free list), so no copy
// writes into it meanwhile; a slot in use is skipped: its copy faulted its pages in.
void HostCache::prefault_loop(const std::function<bool()>& busy) {
  const long sys_page = ::sysconf(_SC_PAGESIZE);
  const uintptr_t page = sys_page > 0 ? static_cast<uintptr_t>(sys_page) : 4096;
  const uintptr_t first = reinterpret_cast<uintptr_t>(base_);
  const uintptr_t slots_end = first + static_cast<uintptr_t>(slots_total_) * slot_bytes_;
  touch_pages(slots_end, first + bytes_, page);  // the tail no slot covers: never handed out
  prefaulted_.fetch_add(first + bytes_ - slots_end, std::memory_order_relaxed);
  // From the last slot down (copies take slot 0 first), in steps: the stop flag and `busy` are
  // checked between steps.
  for (int s = slots_total_ - 1; s >= 0; --s) {
    if (!wait_while(busy)) return;
    const bool held = take_for_prefault(s);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(slot_ptr(s));
    for (uintptr_t a = lo; held && a < lo + slot_bytes_; a += kPrefaultStep) {
      if (stop_prefault_.load(std::memory_order_relaxed)) break;
      touch_pages(a, std::min<uintptr_t>(a + kPrefaultStep, lo + slot_bytes_), page);
    }
    if (held) give_back_prefault(s);
    if (stop_prefault_.load(std::memory_order_relaxed)) return;
    prefaulted_.fetch_add(slot_bytes_, std::memory_order_relaxed);
  }
}

bool HostCache::take_for_prefault(int slot) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = std::find(free_.begin(), free_.end(), slot);
  if (it == free_.end()) return false;
  free_.erase(it);
  prefault_slot_ = slot;
  return true;
}

void HostCache::give_back_prefault(int slot) {
  {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(slot);
    prefault_slot_ = -1;
  }
  cv_.notify_one();
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
  return static_cast<int>(free_.size()) + (prefault_slot_ >= 0 ? 1 : 0);  // lent to the prefault only briefly
}

int HostCache::peak_used() const {
  std::lock_guard<std::mutex> g(mu_);
  return peak_used_;
}

}  // namespace dcpds
