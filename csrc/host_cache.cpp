#include "host_cache.h"

#include <chrono>
#include <cstdlib>
#include <stdexcept>

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
