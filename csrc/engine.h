// The process-wide engine: one host cache, copy workers that stage chunks into it, flush workers
// that write them out, and a read pool for parallel preads. No Python in here (bindings.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fault.h"
#include "host_cache.h"
#include "write_job.h"

namespace dcpds {

struct EngineConfig {
  int64_t cache_bytes = 0;
  int64_t chunk_bytes = int64_t(64) << 20;
  int copy_threads = 2;
  int flush_threads = 2;
  int read_threads = 4;
  int64_t alignment = 4096;
  double cache_wait_timeout_s = 600.0;
};

// A failed system call on the read path (bindings raise OSError / FileNotFoundError).
class IoError : public std::runtime_error {
 public:
  IoError(int err, const std::string& msg) : std::runtime_error(msg), err_(err) {}
  int err() const { return err_; }

 private:
  int err_;
};

// Fewer bytes in the file than a read asked for (bindings raise ValueError).
class ShortReadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One read: nbytes at file_offset into dst.
struct ReadRange {
  uint64_t dst;
  uint64_t file_offset;
  uint64_t nbytes;
};

struct EngineStats {
  uint64_t cache_bytes, chunk_bytes, alignment, cache_address, cache_allocations;
  uint64_t slots_total, slots_free, peak_slots_used;
  uint64_t bytes_staged, bytes_flushed, bytes_read, chunks_staged, chunks_flushed;
  uint64_t jobs_submitted, jobs_done, jobs_failed, backpressure_waits;
  uint64_t copy_threads, flush_threads, read_threads, hw_crc32c;
};

struct ReadBatch;

class Engine {
 public:
  // Throws std::invalid_argument for bad settings, HostAllocError if the cache cannot be allocated.
  explicit Engine(const EngineConfig& cfg);
  ~Engine();  // shutdown()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues one file; returns at once (never waits for slots). Throws std::invalid_argument for a
  // bad layout, std::runtime_error("engine is shut down") after shutdown().
  std::shared_ptr<WriteJob> submit_write(std::string path, std::string header, uint64_t file_size,
                                         const std::vector<WriteItem>& items, bool sync = true, int device = -1);

  // Blocking parallel pread of every range. Throws IoError or ShortReadError.
  void read_into(const std::string& path, const std::vector<ReadRange>& ranges);

  void set_fault(const std::string& kind, uint64_t after_bytes, const std::string& path_substring);

  // Idempotent: stops new submissions, lets every queued job finish, joins all threads.
  void shutdown();
  bool is_shut_down() const { return shut_down_.load(std::memory_order_acquire); }

  uint64_t chunk_bytes() const { return cache_->slot_bytes(); }
  EngineStats stats() const;

 private:
  struct ChunkRef {
    std::shared_ptr<WriteJob> job;
    size_t index;
  };

  void copy_loop();
  void flush_loop();
  void read_loop();
  void stage_chunk(WriteJob& job, Chunk& c);
  void flush_chunk(WriteJob& job, Chunk& c);
  bool ensure_open(WriteJob& job);
  void finalize(WriteJob& job);
  void stop_threads();

  const EngineConfig cfg_;
  std::unique_ptr<HostCache> cache_;
  FaultState faults_;

  std::mutex copy_mu_;
  std::condition_variable copy_cv_;
  std::deque<ChunkRef> copy_q_;
  bool stop_copy_ = false;

  std::mutex flush_mu_;
  std::condition_variable flush_cv_;
  std::deque<ChunkRef> flush_q_;
  bool stop_flush_ = false;

  std::mutex read_mu_;
  std::condition_variable read_cv_;
  std::deque<std::shared_ptr<ReadBatch>> read_q_;
  bool stop_read_ = false;

  std::vector<std::thread> copy_threads_, flush_threads_, read_threads_;
  std::mutex shutdown_mu_;
  bool joined_ = false;
  std::atomic<bool> shut_down_{false};

  std::atomic<uint64_t> bytes_staged_{0}, bytes_flushed_{0}, bytes_read_{0};
  std::atomic<uint64_t> chunks_staged_{0}, chunks_flushed_{0};
  std::atomic<uint64_t> jobs_submitted_{0}, jobs_done_{0}, jobs_failed_{0}, backpressure_waits_{0};
};

}  // namespace dcpds
