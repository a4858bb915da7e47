// The process-wide engine: one host cache, copy workers that stage chunks into it, flush workers
// that write them out, and a read pool for parallel preads. No Python in here (bindings.cpp).
//
// Threads, the locks each takes (in this order when nested), and who gives a cache slot back:
//
//   thread                      locks                                  slots
//   copy worker (copy_loop)     slot_order_mu_ > copy_mu_ (queue pop),  borrows one per chunk, in
//     x copy_threads            then HostCache::mu_ (acquire); device   queue order (acquire_slot)
//                               chunks: DeviceStager::Device::mu
//                               (enqueue the D2H copy); host chunks:
//                               flush_mu_ (push_flush)
//   device completion thread    DeviceStager::Device::done_mu,          none (hands the chunk on
//     (complete_loop), 1/device pool_mu; flush_mu_ (push_flush)         to the flush queue)
//   flush worker (flush_loop)   flush_mu_ (queue pop); FileJob::        file jobs: releases the
//     x flush_threads           open_mu_ (open/close the file);         slot after pwrite (direct
//                                                                       file jobs take none)
//                               StreamJob::smu_ (chunk_ready/drop);     (flush_loop)
//                               HostCache::mu_ (release)
//   read worker (read_loop)     read_mu_; ReadBatch::mu_                none (reads bypass the cache)
//     x read_threads
//   prefault thread (1)         HostCache::mu_ (borrows a free slot     gives its slot back at once
//                               to touch its pages)                     (give_back_prefault)
//   Python caller (bindings)    copy_mu_ (submit), DeviceStager::       streaming jobs: the consumer
//                               init_mu_ (first use of a device),       releases each chunk's slot
//                               read_mu_, shutdown_mu_ (shutdown);      (StreamJob::release); failed
//                               StreamJob::smu_ (next_chunk, release);  or aborted jobs release the
//                               FileJob::open_mu_ > flush_mu_ (set_     slots they hold (drop_held)
//                               destination, fail: parked chunks back)
//
// Jobs (write_job.h): FileJob (the engine writes the file) and StreamJob (a consumer takes the
// bytes) share WriteJob, whose "engine side" methods are how the workers drive either.
//
// No thread holds a queue lock while it waits for a slot except the copy worker holding
// slot_order_mu_ (by design: slots are granted in queue order, which streaming jobs need); a
// slot wait gives up when the job fails or after cache_wait_timeout_s.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "device_stager.h"
#include "cuda_runtime.h"
#include "fault.h"
#include "host_cache.h"
#include "read_batch.h"
#include "write_job.h"

namespace dcpds {

// Every field is set by the caller: the defaults are DataStatesConfig's (dcp_datastates/config.py,
// passed by runtime.py), never the engine's. An unset field is rejected by Engine's constructor.
struct EngineConfig {
  int64_t cache_bytes = 0;
  int64_t chunk_bytes = 0;
  int copy_threads = 0;
  int flush_threads = 0;
  int read_threads = 0;
  int64_t alignment = 0;
  double cache_wait_timeout_s = -1;
  std::optional<bool> pin;       // cudaHostRegister the cache when a CUDA runtime is loaded
  std::optional<bool> prefault;  // fault the whole cache in on a background thread at start
};

struct EngineStats {
  uint64_t cache_bytes, chunk_bytes, alignment, cache_address, cache_allocations;
  uint64_t slots_total, slots_free, peak_slots_used, cache_prefaulted_bytes;
  uint64_t bytes_staged, bytes_flushed, bytes_read, chunks_staged, chunks_flushed;
  uint64_t jobs_submitted, jobs_done, jobs_failed, backpressure_waits;
  uint64_t copy_threads, flush_threads, read_threads, hw_crc32c;
  uint64_t cuda, pinned, d2h_bytes, device_waits, host_waits;
  // Bytes direct file jobs wrote from their sources (no cache slot; not in bytes_staged).
  uint64_t direct_bytes;
  uint64_t direct_io_bytes;  // written past the page cache (O_DIRECT)
  // Jobs whose O_DIRECT writes the file system refused (EINVAL): written through the page cache.
  uint64_t direct_io_refused;
  // Wall time flush workers spent on chunks, and the part of it spent checksumming.
  uint64_t flush_ns, checksum_ns;
};

class Engine {
 public:
  // Throws std::invalid_argument for bad settings, HostAllocError if the cache cannot be allocated.
  // Loads the CUDA runtime (load_cuda_runtime: $DCP_DATASTATES_CUDART, PyTorch's, the usual
  // names); without one, or without a device, the engine runs in CPU mode. With one and
  // cfg.pin, the cache is page-locked here once (a failure leaves it unpinned, see cuda_status).
  explicit Engine(const EngineConfig& cfg);
  ~Engine();  // shutdown()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues one file; returns at once (never waits for slots). Throws std::invalid_argument for a
  // bad layout or device, std::runtime_error("engine is shut down") after shutdown().
  // device >= 0: every src is a pointer into CUDA device `device`, and `stream` is the caller's
  // current stream there (0: the legacy default stream). An event recorded on it now orders the
  // copies after the work that produced the sources; a CUDA error doing so throws
  // std::runtime_error naming the path.
  // named == false: `path` only labels the job until FileJob::set_destination names its file;
  // the copies start now, the writes once it is named.
  // direct == true (host sources only, else std::invalid_argument): no copy into the cache; the
  // flush workers write each chunk from the sources (see FileJob), and the job is staged once
  // the whole file is written.
  std::shared_ptr<WriteJob> submit_write(std::string path, std::string header, uint64_t file_size,
                                         const std::vector<WriteItem>& items, bool sync = true, int device = -1,
                                         uint64_t stream = 0, bool named = true, bool direct = false,
                                         bool direct_io = false);

  // A streaming job: the same layout, grid, copies and per-piece CRC32C as submit_write, but
  // nothing is written: each chunk, once in its cache slot and checksummed, is handed to one
  // consumer in file order (WriteJob::next_chunk / release / abort), which uploads it somewhere
  // (an object store) and gives the slot back. The header is not part of any chunk: the consumer
  // writes it, and fills gaps between chunks and up to file_size with zeros. `label` (a URL)
  // names the job in messages. The job is done once every chunk is released (or it failed).
  // Slots go to chunks in submission order, so a consumer taking chunks in file order always
  // progresses, whatever the cache size; a consumer that stops taking chunks stalls later jobs.
  std::shared_ptr<WriteJob> submit_stream(std::string label, std::string header, uint64_t file_size,
                                          const std::vector<WriteItem>& items, int device = -1, uint64_t stream = 0);

  // Counters kept for streaming jobs (called by WriteJob).
  void note_stream_release(uint64_t bytes);
  void note_job_done(bool failed);

  // For a device job: if all its copies are queued, makes `stream` wait on the GPU for the last
  // of them and returns true (nothing blocks); true as well when the job is staged already.
  // False otherwise (and for host jobs): the caller must wait on the host (job.wait_staged).
  bool device_wait(WriteJob& job, uint64_t stream);

  // Copies each item (src, nbytes, offset) to dst + offset now, in stream order: host memory
  // (device -1) with memcpy on the calling thread; CUDA memory device-to-device on `stream`, the
  // caller's current stream there (see DeviceStager::snapshot). Used at the request for small
  // tensors that forward may change before a lazy copy would read them. Throws on a bad device
  // or a CUDA error, naming `what`.
  void snapshot(int device, uint64_t stream, uint64_t dst, const std::vector<WriteItem>& items, const std::string& what);

  bool cuda_mode() const { return stager_ != nullptr; }
  const std::string& cuda_runtime_path() const { return cuda_path_; }  // "" in CPU mode
  int cuda_device_count() const { return cuda_devices_; }
  // CPU mode: why there is no CUDA. CUDA mode: why the cache is not pinned ("" when it is, or
  // when pinning was not asked for).
  const std::string& cuda_status() const { return cuda_status_; }

  // Blocking parallel pread of every range by up to `threads` workers (0: read_threads), each
  // reading a contiguous, file-ordered part with its own descriptor. Each check is verified
  // right after its bytes are read; the first mismatch is returned (reading stops there).
  // Throws IoError or ShortReadError, std::invalid_argument for bad ranges or checks.
  std::optional<ReadMismatch> read_into(const std::string& path, const std::vector<ReadRange>& ranges,
                                        const std::vector<ReadCheck>& checks = {}, int threads = 0);

  void set_fault(const std::string& kind, uint64_t after_bytes, const std::string& path_substring);
  // Benchmark hook: false skips the per-piece CRC32C (checksums() then reads 0), so the
  // checksum's share of the flush time can be measured. Always on for checkpoints.
  void set_checksums(bool on) { checksums_.store(on, std::memory_order_relaxed); }

  // Idempotent: stops new submissions, lets every queued job finish, joins all threads.
  void shutdown();
  bool is_shut_down() const { return shut_down_.load(std::memory_order_acquire); }

  uint64_t chunk_bytes() const { return cache_->slot_bytes(); }
  EngineStats stats() const;

 private:
  void copy_loop();
  void flush_loop();
  void read_loop();
  std::shared_ptr<WriteJob> submit(std::shared_ptr<WriteJob> job, uint64_t stream);
  int acquire_slot(WriteJob& job, const Chunk& c);
  void take_slot(WriteJob& job, Chunk& c);
  void stream_flush(StreamJob& job, size_t index);
  void stage_chunk(WriteJob& job, Chunk& c);
  void stage_device_chunk(ChunkRef ref);
  void device_chunk_ready(ChunkRef&& ref, bool copied);
  void push_flush(ChunkRef&& ref);
  // A flush worker's next chunk (blocking); false once stopping with nothing queued.
  bool pop_flush(ChunkRef* out);
  void push_flush_front(std::vector<ChunkRef>&& refs);
  void flush_chunk(FileJob& job, Chunk& c);
  // The bytes of chunk c, checksummed block by block as they go: from its cache slot, or for a
  // direct job from each piece's source. Returns "" or the write's error; *crc_ns gets the
  // checksum time. Stops early (returning "") once the job fails.
  // *written_back: the chunk's writeback was started where it was written (past the page cache).
  std::string write_from_slot(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns, bool* written_back);
  // Whether write_from_slot writes chunk `c` of `job` past the page cache (direct_io): an O_DIRECT
  // descriptor whose writes were not refused, and the chunk starts on a page of its file and of
  // its slot.
  bool past_page_cache(const FileJob& job, const Chunk& c) const;
  std::string write_slot_direct_io(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns);
  // Bytes [from, end of c) of c's slot through the page cache, block by block, each block
  // checksummed first unless `first` (the next piece to checksum) is null.
  std::string write_slot_cached(FileJob& job, const Chunk& c, uint64_t from, FaultKind fault, size_t* first,
                                uint64_t* crc_ns);
  std::string write_from_sources(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns);
  // Returns the nanoseconds spent (0 with checksums off).
  uint64_t checksum_range(WriteJob& job, const Chunk& c, const char* base, uint64_t from, uint64_t to,
                          size_t* first_piece) const;
  void finalize(FileJob& job);
  void stop_threads();

  const EngineConfig cfg_;
  std::unique_ptr<HostCache> cache_;
  FaultState faults_;
  std::atomic<bool> checksums_{true};

  std::string cuda_path_, cuda_status_;
  int cuda_devices_ = 0;
  std::unique_ptr<DeviceStager> stager_;  // null in CPU mode
  std::atomic<bool> pinned_{false};

  std::mutex copy_mu_;
  std::condition_variable copy_cv_;
  std::deque<ChunkRef> copy_q_;
  bool stop_copy_ = false;
  // Held by a copy worker from popping a chunk until it holds that chunk's slot (or gave up):
  // slots are granted in queue order, which streaming jobs need (see submit_stream).
  std::mutex slot_order_mu_;

  std::mutex flush_mu_;
  std::condition_variable flush_cv_;
  std::deque<ChunkRef> flush_q_;
  bool stop_flush_ = false;

  // Jobs submitted unnamed (submit_write with named=false), failed at shutdown if still unnamed.
  std::mutex unnamed_mu_;
  std::vector<std::weak_ptr<FileJob>> unnamed_;

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
  std::atomic<uint64_t> d2h_bytes_{0}, device_waits_{0}, host_waits_{0}, direct_bytes_{0},
      direct_io_bytes_{0}, direct_io_refused_{0};
  std::atomic<uint64_t> flush_ns_{0}, checksum_ns_{0};
  // Chunks submitted and not yet handled by a copy worker: the prefault waits while any are.
  std::atomic<int64_t> copies_pending_{0};
};

}  // namespace dcpds
