// DeviceStager: how CUDA device memory reaches the host cache. D2H copies on the engine's own
// stream per device, ordered after the caller's stream, one completion event per chunk, a
// completion thread per device that hands each chunk on once its event completes. Host memory
// is copied by the engine's copy workers (host_copy.h).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "host_copy.h"
#include "write_job.h"

namespace dcpds {

constexpr int kHostDevice = -1;

// Throws std::invalid_argument unless `device` is -1 or, with `cuda_devices` > 0, a device in
// [0, cuda_devices). `cpu_reason` says why there is no CUDA (quoted in the message).
void check_copy_device(int device, int cuda_devices, const std::string& cpu_reason);

class DeviceStager {
 public:
  // ready(ref, copied) runs on a completion thread for every chunk passed to enqueue, in the
  // order enqueued per device, once the chunk's copies are complete (after the job has been
  // marked staged if it was its last chunk). copied: its bytes are in the slot.
  using Ready = std::function<void(ChunkRef&&, bool copied)>;

  DeviceStager(const CudaApi& api, int device_count, Ready ready);
  ~DeviceStager();
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  // On the caller's thread, at submit: records an event on `stream` (the caller's current
  // stream on the job's device) that this job's copies will wait for. Creates the device's copy
  // stream and completion thread on first use. Throws std::runtime_error naming the path and
  // the CUDA error; the job is then not queued.
  void begin_job(WriteJob& job, uint64_t stream);

  // On a copy worker: queues the D2H copies of chunk ref.index into `dst` (its cache slot; null
  // when the chunk is skipped: failed job, empty chunk, no slot) followed by the chunk's event.
  // Every chunk of a job passes through here exactly once, after begin_job.
  void enqueue(ChunkRef ref, char* dst);

  enum class Wait { kDevice, kNotNeeded, kHost };
  // kDevice: `stream` now waits (on the GPU) for the job's last copy. kNotNeeded: the job is
  // staged already. kHost: not every copy is queued yet (or CUDA refused): wait on the host.
  Wait device_wait(WriteJob& job, uint64_t stream);

  // On the caller's thread: queues on `stream` (the caller's current stream on `device`) one
  // device-to-device copy per item, items[i].src -> dst + items[i].offset. Being on the caller's
  // stream, each copy reads the bytes as of the work queued there so far, and kernels queued
  // after it cannot change what it reads. Throws std::runtime_error naming `what` and the error.
  void snapshot(int device, uint64_t stream, uint64_t dst, const std::vector<WriteItem>& items,
                const std::string& what);

  // Drains the completion threads and joins them, then destroys the streams and events. Call
  // once no more chunks will be enqueued. Idempotent.
  void stop();

 private:
  struct Pending {
    ChunkRef ref;
    CudaEvent event;  // null: nothing was queued for this chunk
  };
  struct Device {
    int index = 0;
    CudaStream stream = nullptr;
    std::mutex mu;  // one enqueuer at a time: stream order == completion queue order
    std::mutex pool_mu;
    std::vector<CudaEvent> pool;  // free events (created on this device)
    std::mutex done_mu;
    std::condition_variable done_cv;
    std::deque<Pending> done_q;
    bool stop = false;
    std::thread thread;
  };

  Device& device(int index);  // under init_mu_: created on first use, throws on CUDA errors
  CudaEvent take_event(Device& d, cudaError* err);  // needs d current on the calling thread
  void give_event(Device& d, CudaEvent e);
  void complete_loop(Device& d);
  std::string fail_text(const WriteJob& job, const std::string& what, cudaError err) const;

  const CudaApi& api_;
  const Ready ready_;
  std::mutex init_mu_;
  bool stopped_ = false;
  std::vector<std::unique_ptr<Device>> devices_;  // one per device, null until first used
};

}  // namespace dcpds
