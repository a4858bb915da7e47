#include "device_stager.h"

#include <cstdio>
#include <stdexcept>
#include <string>

namespace dcpds {

void check_copy_device(int device, int cuda_devices, const std::string& cpu_reason) {
  if (device == kHostDevice) return;
  if (cuda_devices <= 0)
    throw std::invalid_argument("device " + std::to_string(device) + " is not supported: the engine runs in CPU mode (" +
                                cpu_reason + "); only host memory (device=-1) can be copied");
  if (device < 0 || device >= cuda_devices)
    throw std::invalid_argument("device " + std::to_string(device) + " is out of range: the CUDA runtime sees " +
                                std::to_string(cuda_devices) + " device(s); use -1 for host memory");
}

// ---------------------------------------------------------------------------------------------

DeviceStager::DeviceStager(const CudaApi& api, int device_count, Ready ready)
    : api_(api), ready_(std::move(ready)), devices_(static_cast<size_t>(device_count > 0 ? device_count : 0)) {}

DeviceStager::~DeviceStager() { stop(); }

std::string DeviceStager::fail_text(const WriteJob& job, const std::string& what, cudaError err) const {
  return job.path() + ": " + what + " failed: " + api_.error_text(err);
}

DeviceStager::Device& DeviceStager::device(int index) {
  std::unique_ptr<Device>& slot = devices_.at(static_cast<size_t>(index));
  if (slot) return *slot;
  auto d = std::make_unique<Device>();
  d->index = index;
  DeviceGuard guard(api_, index);
  if (guard.error() != kCudaSuccess)
    throw std::runtime_error("cudaSetDevice(" + std::to_string(index) + ") failed: " + api_.error_text(guard.error()));
  // Non-blocking: the copies never serialize with the legacy default stream; ordering after the
  // caller's work comes from the event recorded at submit.
  cudaError err = api_.StreamCreateWithFlags(&d->stream, kCudaStreamNonBlocking);
  if (err != kCudaSuccess)
    throw std::runtime_error("creating the copy stream on device " + std::to_string(index) + " failed: " +
                             api_.error_text(err));
  Device* raw = d.get();
  try {
    d->thread = std::thread([this, raw] { complete_loop(*raw); });
  } catch (...) {
    api_.StreamDestroy(d->stream);
    throw;
  }
  slot = std::move(d);
  return *slot;
}

CudaEvent DeviceStager::take_event(Device& d, cudaError* err) {
  {
    std::lock_guard<std::mutex> g(d.pool_mu);
    if (!d.pool.empty()) {
      CudaEvent e = d.pool.back();
      d.pool.pop_back();
      *err = kCudaSuccess;
      return e;
    }
  }
  // Blocking sync: the completion thread sleeps in cudaEventSynchronize instead of spinning a
  // core the training process needs.
  CudaEvent e = nullptr;
  *err = api_.EventCreateWithFlags(&e, kCudaEventBlockingSync | kCudaEventDisableTiming);
  return *err == kCudaSuccess ? e : nullptr;
}

void DeviceStager::give_event(Device& d, CudaEvent e) {
  // Re-recording an event is allowed while earlier waits on it are pending: a wait uses the
  // record that was current when the wait was issued.
  std::lock_guard<std::mutex> g(d.pool_mu);
  d.pool.push_back(e);
}

void DeviceStager::begin_job(WriteJob& job, uint64_t stream) {
  std::lock_guard<std::mutex> g(init_mu_);
  if (stopped_) throw std::runtime_error("engine is shut down");
  Device* d;
  try {
    d = &device(job.device());
  } catch (const std::exception& e) {
    throw std::runtime_error(job.path() + ": " + e.what());
  }
  DeviceGuard guard(api_, d->index);  // stream 0 means the current device's default stream
  if (guard.error() != kCudaSuccess)
    throw std::runtime_error(fail_text(job, "cudaSetDevice(" + std::to_string(d->index) + ")", guard.error()));
  cudaError err;
  CudaEvent e = take_event(*d, &err);
  if (!e) throw std::runtime_error(fail_text(job, "cudaEventCreateWithFlags", err));
  err = api_.EventRecord(e, reinterpret_cast<CudaStream>(static_cast<uintptr_t>(stream)));
  if (err != kCudaSuccess) {
    give_event(*d, e);
    char hex[32];
    std::snprintf(hex, sizeof hex, "%#llx", static_cast<unsigned long long>(stream));
    throw std::runtime_error(fail_text(job, std::string("cudaEventRecord on the caller's stream ") + hex, err));
  }
  job.entry_event() = e;
}

void DeviceStager::enqueue(ChunkRef ref, char* dst) {
  WriteJob& job = *ref.job;
  const Chunk& c = job.chunk(ref.index);
  Device& d = *devices_[static_cast<size_t>(job.device())];  // created by begin_job
  DeviceGuard guard(api_, d.index);
  CudaEvent done = nullptr;
  {
    std::lock_guard<std::mutex> g(d.mu);
    if (guard.error() != kCudaSuccess && !job.failed())
      job.fail(fail_text(job, "cudaSetDevice(" + std::to_string(d.index) + ") on a copy worker", guard.error()));
    if (job.entry_event()) {
      // The first chunk of the job in stream order: from here on the copy stream runs only
      // after everything the caller's stream had queued at submit (the tensors' producers).
      if (!job.failed()) {
        cudaError err = api_.StreamWaitEvent(d.stream, job.entry_event(), 0);
        if (err != kCudaSuccess) job.fail(fail_text(job, "cudaStreamWaitEvent (copy stream on the caller's stream)", err));
      }
      give_event(d, job.entry_event());
      job.entry_event() = nullptr;
    }
    size_t queued = 0;
    if (dst && !job.failed()) {
      place_pieces(dst, c, job.pieces(), [&](char* to, const Piece& p) {
        cudaError err = api_.MemcpyAsync(to, p.src, static_cast<size_t>(p.len), kCudaMemcpyDeviceToHost, d.stream);
        if (err != kCudaSuccess) {
          char what[160];
          std::snprintf(what, sizeof what, "cudaMemcpyAsync of %llu bytes from device %d (src %p) for file offset %llu",
                        static_cast<unsigned long long>(p.len), d.index, static_cast<const void*>(p.src),
                        static_cast<unsigned long long>(p.file_off));
          job.fail(fail_text(job, what, err));
          return false;
        }
        ++queued;
        return true;
      });
    }
    if (queued) {
      // The slot may be reused only after what was queued into it has run.
      cudaError err = kCudaSuccess;
      done = take_event(d, &err);
      if (done && (err = api_.EventRecord(done, d.stream)) != kCudaSuccess) {
        give_event(d, done);
        done = nullptr;
      }
      if (!done) {
        job.fail(fail_text(job, "recording the completion event of the chunk at file offset " + std::to_string(c.file_off), err));
        api_.StreamSynchronize(d.stream);  // no event to wait for: make sure the slot is free
      }
    }
    // Chunks of a device job are counted only here, under d.mu, so enqueue order is stream order.
    const bool last = job.chunks_enqueued() + 1 == job.nchunks();
    if (last && !job.failed()) {
      // An event recorded after the job's last chunk follows every copy of the job.
      cudaError err = kCudaSuccess;
      CudaEvent e = take_event(d, &err);
      if (e && api_.EventRecord(e, d.stream) == kCudaSuccess) {
        std::lock_guard<std::mutex> lg(job.cuda_mutex());
        job.last_event() = e;
      } else if (e) {
        give_event(d, e);  // device_wait falls back to a host wait
      }
    }
    job.chunk_enqueued();  // all_enqueued() turns true only once last_event_ is in place
    std::lock_guard<std::mutex> q(d.done_mu);
    d.done_q.push_back(Pending{std::move(ref), done});
  }
  d.done_cv.notify_one();
}

void DeviceStager::complete_loop(Device& d) {
  api_.SetDevice(d.index);  // an engine thread: nothing to restore
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lk(d.done_mu);
      d.done_cv.wait(lk, [&] { return !d.done_q.empty() || d.stop; });
      if (d.done_q.empty()) return;  // stopping and drained
      p = std::move(d.done_q.front());
      d.done_q.pop_front();
    }
    WriteJob& job = *p.ref.job;
    bool copied = false;
    if (p.event) {
      cudaError err = api_.EventSynchronize(p.event);
      if (err != kCudaSuccess) {
        const Chunk& c = job.chunk(p.ref.index);
        job.fail(fail_text(job, "waiting for the device-to-host copy of the chunk at file offset " + std::to_string(c.file_off) +
                                    " (cudaEventSynchronize, device " + std::to_string(d.index) + ")",
                           err));
      } else {
        copied = true;
      }
      give_event(d, p.event);
    }
    if (job.chunk_staged()) {
      // Every copy of the job is complete: later device_wait calls need no event.
      CudaEvent last;
      {
        std::lock_guard<std::mutex> g(job.cuda_mutex());
        last = job.last_event();
        job.last_event() = nullptr;
      }
      if (last) give_event(d, last);
    }
    ready_(std::move(p.ref), copied);
  }
}

void DeviceStager::snapshot(int device, uint64_t stream, uint64_t dst, const std::vector<WriteItem>& items,
                            const std::string& what) {
  DeviceGuard guard(api_, device);
  if (guard.error() != kCudaSuccess)
    throw std::runtime_error(what + ": cudaSetDevice(" + std::to_string(device) + "): " + api_.error_text(guard.error()));
  auto* s = reinterpret_cast<CudaStream>(static_cast<uintptr_t>(stream));
  for (const WriteItem& it : items) {
    if (it.nbytes == 0) continue;
    void* to = reinterpret_cast<void*>(static_cast<uintptr_t>(dst + it.offset));
    const void* from = reinterpret_cast<const void*>(static_cast<uintptr_t>(it.src));
    const cudaError err = api_.MemcpyAsync(to, from, static_cast<size_t>(it.nbytes), kCudaMemcpyDeviceToDevice, s);
    if (err != kCudaSuccess) throw std::runtime_error(what + ": cudaMemcpyAsync (snapshot on the caller's stream): " + api_.error_text(err));
  }
}

DeviceStager::Wait DeviceStager::device_wait(WriteJob& job, uint64_t stream) {
  if (job.is_staged()) return Wait::kNotNeeded;
  if (!job.all_enqueued()) return Wait::kHost;
  std::lock_guard<std::mutex> g(job.cuda_mutex());
  if (!job.last_event()) return job.is_staged() ? Wait::kNotNeeded : Wait::kHost;
  DeviceGuard guard(api_, job.device());  // stream 0 means the current device's default stream
  if (guard.error() != kCudaSuccess) return Wait::kHost;
  cudaError err = api_.StreamWaitEvent(reinterpret_cast<CudaStream>(static_cast<uintptr_t>(stream)), job.last_event(), 0);
  return err == kCudaSuccess ? Wait::kDevice : Wait::kHost;
}

void DeviceStager::stop() {
  {
    std::lock_guard<std::mutex> g(init_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  for (auto& d : devices_) {
    if (!d) continue;
    {
      std::lock_guard<std::mutex> g(d->done_mu);
      d->stop = true;
    }
    d->done_cv.notify_all();
    d->thread.join();
  }
  for (auto& d : devices_) {
    if (!d) continue;
    DeviceGuard guard(api_, d->index);
    api_.StreamSynchronize(d->stream);
    api_.StreamDestroy(d->stream);
    d->stream = nullptr;
    std::lock_guard<std::mutex> g(d->pool_mu);
    for (CudaEvent e : d->pool) api_.EventDestroy(e);
    d->pool.clear();
  }
}

}  // namespace dcpds
