#include "engine.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "device_stager.h"
#include "crc32c.h"
#include "fault_guard.h"
#include "io_util.h"

namespace {

// Optional lower priority for the copy and flush threads (DCP_DATASTATES_WORKER_NICE=N, this
// thread only; default 0 = unchanged). On a CPU-only machine they share the cores with training:
// nice +10 cut the compute slowdown during a checkpoint by an order of magnitude in the benchmark,
// but with a checkpoint every iteration on 2 cores it delays durability more than it saves (the
// iterations got longer, not shorter), so it is opt-in. Best effort.
void lower_thread_priority() {
  const char* env = std::getenv("DCP_DATASTATES_WORKER_NICE");
  const int nice = env ? std::atoi(env) : 0;
  const long tid = syscall(SYS_gettid);
  if (nice > 0 && tid > 0) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
}

}  // namespace

namespace dcpds {

namespace {

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// Flush granularity inside a slot: small enough to stay in a core's L2 between the checksum
// and the kernel's copy, large enough that the extra pwrite calls cost nothing measurable.
constexpr uint64_t kFlushBlock = uint64_t(256) << 10;

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

std::string internal_error(const std::string& path, const char* what) {
  return path + ": internal error in the write engine: " + what;
}

// Why a job failed whose source memory went away while it was read (fault_guard.h).
std::string source_gone(const Piece& p) {
  return "the source memory of file bytes [" + std::to_string(p.file_off) + ", " + std::to_string(p.file_off + p.len) +
         ") was unmapped while it was copied: a tensor of the state was freed or resized (or an mmap'ed file "
         "truncated) before the save was staged; nothing of this save is committed";
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Engine::Engine(const EngineConfig& cfg) : cfg_(cfg) {
  if (cfg.cache_bytes <= 0) throw std::invalid_argument("cache_bytes must be positive, got " + std::to_string(cfg.cache_bytes));
  if (cfg.chunk_bytes <= 0) throw std::invalid_argument("chunk_bytes must be positive, got " + std::to_string(cfg.chunk_bytes));
  if (cfg.alignment <= 0 || (cfg.alignment & (cfg.alignment - 1)) != 0)
    throw std::invalid_argument("alignment must be a power of two, got " + std::to_string(cfg.alignment));
  if (cfg.copy_threads < 1) throw std::invalid_argument("copy_threads must be at least 1, got " + std::to_string(cfg.copy_threads));
  if (cfg.flush_threads < 1) throw std::invalid_argument("flush_threads must be at least 1, got " + std::to_string(cfg.flush_threads));
  if (cfg.read_threads < 1) throw std::invalid_argument("read_threads must be at least 1, got " + std::to_string(cfg.read_threads));
  if (!(cfg.cache_wait_timeout_s >= 0))  // also rejects NaN
    throw std::invalid_argument("cache_wait_timeout_s must be >= 0, got " + std::to_string(cfg.cache_wait_timeout_s));
  if (!cfg.pin.has_value()) throw std::invalid_argument("pin must be set");
  if (!cfg.prefault.has_value()) throw std::invalid_argument("prefault must be set");
  install_fault_guard();  // the copies read the sources under it (stage_chunk, write_from_sources)

  // Effective chunk: at most a quarter of the cache so copy and flush overlap, aligned, and
  // never larger than the cache itself (a tiny cache is one slot).
  const uint64_t cache = static_cast<uint64_t>(cfg.cache_bytes);
  const uint64_t align = static_cast<uint64_t>(cfg.alignment);
  uint64_t chunk = std::min<uint64_t>(static_cast<uint64_t>(cfg.chunk_bytes), cache / 4);
  chunk = std::max<uint64_t>(align, chunk);
  chunk -= chunk % align;
  if (chunk > cache) chunk = cache;
  cache_ = std::make_unique<HostCache>(cache, chunk, align);

  if (const CudaApi* cuda = load_cuda_runtime(&cuda_status_)) {
    int n = 0;
    const cudaError err = cuda->GetDeviceCount(&n);
    if (err != kCudaSuccess || n <= 0) {
      cuda_status_ = cuda->path + " sees no CUDA device" + (err != kCudaSuccess ? ": " + cuda->error_text(err) : "");
    } else {
      cuda_path_ = cuda->path;
      cuda_devices_ = n;
      cuda_status_.clear();
      stager_ = std::make_unique<DeviceStager>(*cuda, n, [this](ChunkRef&& ref, bool copied) {
        device_chunk_ready(std::move(ref), copied);
      });
      // Once, for the engine's lifetime: every checkpoint reuses the pinned cache.
      if (*cfg.pin) {
        cuda_status_ = cache_->pin(*cuda);
        pinned_.store(cache_->pinned(), std::memory_order_release);
      }
    }
  }

  try {
    for (int i = 0; i < cfg.copy_threads; ++i)
      copy_threads_.emplace_back([this] { lower_thread_priority(); copy_loop(); });
    for (int i = 0; i < cfg.flush_threads; ++i)
      flush_threads_.emplace_back([this] { lower_thread_priority(); flush_loop(); });
    for (int i = 0; i < cfg.read_threads; ++i) read_threads_.emplace_back([this] { read_loop(); });
  } catch (...) {
    stop_threads();
    throw;
  }
  // After pinning: a pinned cache is resident already. Never waited for: copies are correct
  // either way, and shutdown stops it between two steps.
  if (*cfg.prefault) cache_->start_prefault([this] { return copies_pending_.load(std::memory_order_relaxed) > 0; });
}

Engine::~Engine() { shutdown(); }

std::shared_ptr<WriteJob> Engine::submit_write(std::string path, std::string header, uint64_t file_size,
                                               const std::vector<WriteItem>& items, bool sync, int device,
                                               uint64_t stream, bool named, bool direct, bool direct_io) {
  if (is_shut_down()) throw std::runtime_error("engine is shut down");
  // A device's memory reaches a file only through the cache (the D2H copy needs a host buffer).
  if (direct && device != kHostDevice)
    throw std::invalid_argument(path + ": a direct write needs host sources, got CUDA device " + std::to_string(device));
  check_copy_device(device, cuda_devices_, cuda_status_);
  auto job = std::make_shared<FileJob>(std::move(path), std::move(header), file_size, items, chunk_bytes(), sync, device,
                                       named, direct,
                                       [this](std::vector<ChunkRef>&& refs) { push_flush_front(std::move(refs)); },
                                       sync && !direct && direct_io);
  if (!named) {
    std::lock_guard<std::mutex> g(unnamed_mu_);
    unnamed_.erase(std::remove_if(unnamed_.begin(), unnamed_.end(),
                                  [](const std::weak_ptr<FileJob>& w) {
                                    auto j = w.lock();
                                    return !j || !j->awaiting_name();
                                  }),
                   unnamed_.end());
    unnamed_.push_back(job);
  }
  return submit(job, stream);
}

std::shared_ptr<WriteJob> Engine::submit_stream(std::string label, std::string header, uint64_t file_size,
                                                const std::vector<WriteItem>& items, int device, uint64_t stream) {
  if (is_shut_down()) throw std::runtime_error("engine is shut down");
  check_copy_device(device, cuda_devices_, cuda_status_);
  return submit(std::make_shared<StreamJob>(std::move(label), std::move(header), file_size, items, chunk_bytes(), device,
                                           cache_.get(), this),
                stream);
}

std::shared_ptr<WriteJob> Engine::submit(std::shared_ptr<WriteJob> job, uint64_t stream) {
  if (job->direct()) {
    // Nothing to copy: the flush workers read the sources. Under copy_mu_ all the same, so that
    // shutdown (which stops copies, then flushes) either sees the job or refuses it.
    std::lock_guard<std::mutex> g(copy_mu_);
    if (stop_copy_) throw std::runtime_error("engine is shut down");
    {
      std::lock_guard<std::mutex> f(flush_mu_);
      for (size_t k = 0; k < job->nchunks(); ++k) flush_q_.push_back(ChunkRef{job, k});
    }
    jobs_submitted_.fetch_add(1, std::memory_order_relaxed);
    flush_cv_.notify_all();
    return job;
  }
  {
    std::lock_guard<std::mutex> g(copy_mu_);
    if (stop_copy_) throw std::runtime_error("engine is shut down");
    if (job->device() != kHostDevice) stager_->begin_job(*job, stream);  // the ordering point
    for (size_t k = 0; k < job->nchunks(); ++k) copy_q_.push_back(ChunkRef{job, k});
    copies_pending_.fetch_add(static_cast<int64_t>(job->nchunks()), std::memory_order_relaxed);
    jobs_submitted_.fetch_add(1, std::memory_order_relaxed);
  }
  copy_cv_.notify_all();
  return job;
}

void Engine::note_stream_release(uint64_t bytes) {
  bytes_flushed_.fetch_add(bytes, std::memory_order_relaxed);
  chunks_flushed_.fetch_add(1, std::memory_order_relaxed);
}

void Engine::note_job_done(bool failed) {
  jobs_done_.fetch_add(1, std::memory_order_relaxed);
  if (failed) jobs_failed_.fetch_add(1, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Copy workers: FIFO over chunks of all jobs; block for a slot (backpressure), fill it.
// Slots are granted in queue order: a worker holds slot_order_mu_ from popping a chunk until it
// has that chunk's slot, so no later chunk can take the last free slot from an earlier one.
// (A streaming consumer waits for its chunks in file order; were chunk k left without a slot
// while later chunks held them all, it would wait forever.)

void Engine::copy_loop() {
  for (;;) {
    ChunkRef ref;
    {
      std::lock_guard<std::mutex> order(slot_order_mu_);
      {
        std::unique_lock<std::mutex> lk(copy_mu_);
        copy_cv_.wait(lk, [&] { return !copy_q_.empty() || stop_copy_; });
        if (copy_q_.empty()) return;  // stopping and drained
        ref = std::move(copy_q_.front());
        copy_q_.pop_front();
      }
      take_slot(*ref.job, ref.job->chunk(ref.index));
    }
    WriteJob& job = *ref.job;
    if (job.device() != kHostDevice) {
      stage_device_chunk(std::move(ref));  // handed on by the device's completion thread
    } else {
      stage_chunk(job, job.chunk(ref.index));
      job.chunk_enqueued();
      job.chunk_staged();
      push_flush(std::move(ref));
    }
    copies_pending_.fetch_sub(1, std::memory_order_relaxed);
  }
}

void Engine::push_flush(ChunkRef&& ref) {
  {
    std::lock_guard<std::mutex> g(flush_mu_);
    flush_q_.push_back(std::move(ref));
  }
  flush_cv_.notify_one();
}

// A named (or failed) job's parked chunks, in file order, ahead of everything queued.
void Engine::push_flush_front(std::vector<ChunkRef>&& refs) {
  {
    std::lock_guard<std::mutex> g(flush_mu_);
    flush_q_.insert(flush_q_.begin(), std::make_move_iterator(refs.begin()), std::make_move_iterator(refs.end()));
  }
  flush_cv_.notify_all();
}

// Borrows a cache slot for chunk c (backpressure); -1 after failing the job on timeout, or at
// once when the job fails meanwhile (aborted: its chunks need no slot). Waits in short slices
// so an abort is seen within one of them.
int Engine::acquire_slot(WriteJob& job, const Chunk& c) {
  constexpr double kSlice = 0.05;
  bool waited = false;
  int slot = -1;
  const double limit = cfg_.cache_wait_timeout_s;
  for (double spent = 0;;) {
    bool w = false;
    const double slice = std::min(kSlice, std::max(0.0, limit - spent));
    slot = cache_->acquire(slice, &w);
    waited = waited || w;
    if (slot >= 0 || job.failed()) break;
    spent += slice;
    if (spent >= limit) break;
  }
  if (waited) backpressure_waits_.fetch_add(1, std::memory_order_relaxed);
  if (slot < 0 && job.failed()) return -1;
  if (slot < 0) {
    char secs[64];
    std::snprintf(secs, sizeof secs, "%g", cfg_.cache_wait_timeout_s);
    job.fail(job.path() + ": host cache full for " + std::string(secs) + " s: no free slot among " +
             std::to_string(cache_->slots_total()) + " for the chunk at offset " + std::to_string(c.file_off) +
             "; flushes are stalled or much slower than copies (raise cache_wait_timeout or host_cache_size)");
  }
  return slot;
}

// Borrows the slot of chunk c (in queue order, see copy_loop); failed jobs and empty chunks
// take none. c.slot stays -1 when there is none.
void Engine::take_slot(WriteJob& job, Chunk& c) {
  if (job.failed() || c.span == 0) return;  // failed jobs skip their remaining chunks
  const int slot = acquire_slot(job, c);
  if (slot >= 0) c.slot = slot;
}

void Engine::stage_chunk(WriteJob& job, Chunk& c) {
  try {
    if (job.failed() || c.slot < 0) return;  // the slot goes back in the flush worker
    const int slot = c.slot;
    const bool copied = place_pieces(cache_->slot_ptr(slot), c, job.pieces(), [&job](char* dst, const Piece& p) {
      const size_t n = static_cast<size_t>(p.len);
      if (read_guarded(p.src, n, [&] { copy_bytes(dst, p.src, n); })) return true;
      job.fail(job.path() + ": " + source_gone(p));
      return false;
    });
    if (!copied) return;
    bytes_staged_.fetch_add(c.data_bytes, std::memory_order_relaxed);
    chunks_staged_.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    job.fail(internal_error(job.path(), e.what()));
  } catch (...) {
    job.fail(internal_error(job.path(), "unknown exception"));
  }
}

// A copy worker's share of a device chunk: the slot (waiting for one on the host when the cache
// is full), then the stager queues the D2H copies and the chunk's event on the copy stream.
void Engine::stage_device_chunk(ChunkRef ref) {
  WriteJob& job = *ref.job;
  Chunk& c = job.chunk(ref.index);
  char* dst = nullptr;
  if (!job.failed() && c.slot >= 0) dst = cache_->slot_ptr(c.slot);  // else given back by flush
  try {
    stager_->enqueue(std::move(ref), dst);
  } catch (const std::exception& e) {  // bad_alloc of a queue node: nothing else throws there
    job.fail(internal_error(job.path(), e.what()));
  }
}

// On a device's completion thread, once the chunk's copies are complete (the job is marked
// staged already when this was its last chunk).
void Engine::device_chunk_ready(ChunkRef&& ref, bool copied) {
  if (copied) {
    const Chunk& c = ref.job->chunk(ref.index);
    bytes_staged_.fetch_add(c.data_bytes, std::memory_order_relaxed);
    d2h_bytes_.fetch_add(c.data_bytes, std::memory_order_relaxed);
    chunks_staged_.fetch_add(1, std::memory_order_relaxed);
  }
  push_flush(std::move(ref));
}

void Engine::snapshot(int device, uint64_t stream, uint64_t dst, const std::vector<WriteItem>& items,
                      const std::string& what) {
  check_copy_device(device, cuda_devices_, cuda_status_);
  // Checked before any copy: a null source (a tensor with no memory) must be an error, not a crash.
  for (size_t i = 0; i < items.size(); ++i) {
    const WriteItem& it = items[i];
    if (it.nbytes && (it.src == 0 || dst == 0))
      throw std::invalid_argument(what + ": snapshot item " + std::to_string(i) + " of " + std::to_string(it.nbytes) +
                                  " bytes has a null " + (it.src == 0 ? "source" : "destination"));
  }
  if (device != kHostDevice) {
    stager_->snapshot(device, stream, dst, items, what);
    return;
  }
  for (const WriteItem& it : items)
    if (it.nbytes) std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(dst + it.offset)),
                               reinterpret_cast<const void*>(static_cast<uintptr_t>(it.src)), static_cast<size_t>(it.nbytes));
}

bool Engine::device_wait(WriteJob& job, uint64_t stream) {
  if (!stager_ || job.device() == kHostDevice) return false;
  switch (stager_->device_wait(job, stream)) {
    case DeviceStager::Wait::kDevice:
      device_waits_.fetch_add(1, std::memory_order_relaxed);
      return true;
    case DeviceStager::Wait::kNotNeeded:
      return true;
    case DeviceStager::Wait::kHost:
      break;
  }
  host_waits_.fetch_add(1, std::memory_order_relaxed);
  return false;
}

// ---------------------------------------------------------------------------------------------
// Flush workers: write the slot, checksum its pieces, give the slot back, finish the job.

// The first queued chunk of a file no other worker is writing (among the first kLookahead),
// else the first chunk: writes into one file are serialized by its inode lock (tmpfs, ext4), so
// two workers on two files write about twice as fast as on one (on tmpfs).
// A file's own chunks stay in queue order.
bool Engine::pop_flush(ChunkRef* out) {
  constexpr size_t kLookahead = 64;
  std::unique_lock<std::mutex> lk(flush_mu_);
  flush_cv_.wait(lk, [&] { return !flush_q_.empty() || stop_flush_; });
  if (flush_q_.empty()) return false;
  auto pick = flush_q_.begin();
  const auto last = flush_q_.begin() + static_cast<std::ptrdiff_t>(std::min(kLookahead, flush_q_.size()));
  for (auto it = flush_q_.begin(); it != last; ++it) {
    if (it->job->stream() || it->job->writers().load(std::memory_order_relaxed) == 0) {
      pick = it;
      break;
    }
    // Skipping a file's chunk means skipping its later ones too (file order within a file).
    const WriteJob* busy = it->job.get();
    while (it + 1 != last && (it + 1)->job.get() == busy) ++it;
  }
  *out = std::move(*pick);
  flush_q_.erase(pick);
  out->job->writers().fetch_add(1, std::memory_order_relaxed);  // under flush_mu_: seen by the next pick
  return true;
}

void Engine::flush_loop() {
  for (;;) {
    ChunkRef ref;
    if (!pop_flush(&ref)) return;
    // The job's writer count drops however the chunk ends. Its own reference: a parked chunk's
    // ref moves into the job, which may then be finished and dropped by others before this ends.
    struct Writing {
      std::shared_ptr<WriteJob> job;
      ~Writing() { job->writers().fetch_sub(1, std::memory_order_relaxed); }
    } writing{ref.job};
    if (ref.job->stream()) {
      stream_flush(static_cast<StreamJob&>(*ref.job), ref.index);
      continue;
    }
    auto& job = static_cast<FileJob&>(*ref.job);  // the only other kind
    if (!job.admit(ref)) continue;  // its file is not named yet: the job keeps the chunk
    Chunk& c = job.chunk(ref.index);
    flush_chunk(job, c);
    if (!job.failed()) job.chunk_written(ref.index);
    if (c.slot >= 0) {
      cache_->release(c.slot);
      c.slot = -1;
    }
    if (job.direct()) {
      // Its sources are read: for a direct job, the write was the copy.
      job.chunk_enqueued();
      job.chunk_staged();
    }
    if (job.chunk_flushed()) finalize(job);
  }
}

// A streaming chunk: checksum its pieces while the bytes are hot, then hand it to the consumer
// (the slot stays borrowed until WriteJob::release); failed jobs and empty chunks just finish.
void Engine::stream_flush(StreamJob& job, size_t index) {
  const Chunk& c = job.chunk(index);
  if (job.failed() || c.slot < 0 || c.span == 0) {
    job.chunk_drop(index);
    return;
  }
  size_t first = c.piece_begin;
  const uint64_t ns = checksum_range(job, c, cache_->slot_ptr(c.slot), c.file_off, c.file_off + c.span, &first);
  checksum_ns_.fetch_add(ns, std::memory_order_relaxed);
  flush_ns_.fetch_add(ns, std::memory_order_relaxed);
  job.chunk_ready(index);
}

void Engine::flush_chunk(FileJob& job, Chunk& c) {
  try {
    if (job.failed() || c.span == 0 || (c.slot < 0 && !job.direct())) return;
    if (!job.open_once()) return;
    const FaultKind fault = faults_.active_for(job.file_path(), bytes_flushed_.load(std::memory_order_relaxed));
    const uint64_t t0 = now_ns();
    uint64_t crc_ns = 0;
    while (fault == FaultKind::kStall && !job.failed() &&
           faults_.active_for(job.file_path(), bytes_flushed_.load(std::memory_order_relaxed)) == FaultKind::kStall)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    bool written_back = false;  // the chunk's writeback was started (or needs none) where it was written
    const std::string err = job.direct() ? write_from_sources(job, c, fault, &crc_ns)
                                         : write_from_slot(job, c, fault, &crc_ns, &written_back);
    checksum_ns_.fetch_add(crc_ns, std::memory_order_relaxed);
    flush_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    if (!err.empty()) {
      job.fail(job.file_path() + ": " + err);
      return;
    }
    if (job.failed()) return;  // aborted meanwhile: the rest of the chunk was dropped
    if (job.sync() && !written_back) start_writeback(job.fd(), c.file_off, c.span);
    bytes_flushed_.fetch_add(c.data_bytes, std::memory_order_relaxed);
    if (job.direct()) direct_bytes_.fetch_add(c.data_bytes, std::memory_order_relaxed);
    job.add_bytes_done(c.data_bytes);
    chunks_flushed_.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    job.fail(internal_error(job.file_path(), e.what()));
  } catch (...) {
    job.fail(internal_error(job.file_path(), "unknown exception"));
  }
}

// Checksum, then write, one block at a time: the checksum pulls the block into the core's L2 and
// the kernel's copy into the page cache reads it from there, so the checksum costs no extra pass
// over memory (a few percent over the bare pwrite, several times less than checksumming the
// whole slot after one pwrite; measured with scripts/crc_cost.py).
std::string Engine::write_from_slot(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns,
                                    bool* written_back) {
  if (past_page_cache(job, c)) {
    *written_back = true;
    return write_slot_direct_io(job, c, fault, crc_ns);
  }
  size_t first = c.piece_begin;
  return write_slot_cached(job, c, c.file_off, fault, &first, crc_ns);
}

std::string Engine::write_slot_cached(FileJob& job, const Chunk& c, uint64_t from, FaultKind fault, size_t* first,
                                      uint64_t* crc_ns) {
  const char* base = cache_->slot_ptr(c.slot);
  const uint64_t end = c.file_off + c.span;
  fault = through_page_cache(fault);
  for (uint64_t pos = from; pos < end;) {
    if (job.failed()) return "";  // aborted (or failed elsewhere): drop the rest of the chunk
    const uint64_t stop = std::min(end, pos + kFlushBlock);
    if (first != nullptr) *crc_ns += checksum_range(job, c, base, pos, stop, first);
    std::string err = pwrite_full(job.fd(), base + (pos - c.file_off), static_cast<size_t>(stop - pos), pos, fault);
    if (!err.empty()) return err;
    pos = stop;
  }
  return "";
}

bool Engine::past_page_cache(const FileJob& job, const Chunk& c) const {
  return job.direct_io_fd() >= 0 && !job.direct_io_refused() && c.slot >= 0 && c.span >= kDirectIoAlign &&
         c.file_off % kDirectIoAlign == 0 && reinterpret_cast<uintptr_t>(cache_->slot_ptr(c.slot)) % kDirectIoAlign == 0;
}

// A chunk that starts on a page of its file and of its slot, past the page cache: its checksums
// first (the whole slot: the device reads it, not the core), then its whole pages in one O_DIRECT
// write, which leaves the kernel no copy to make and no dirty pages to write back, and the last
// partial page, if any, through the page cache (the final fsync covers both). Whole pages only:
// no page of the file is written both ways. A file system that opened the file with O_DIRECT may
// still refuse the writes (EINVAL: it wants another alignment): the chunk is then written again
// through the page cache, and so are the job's later chunks.
std::string Engine::write_slot_direct_io(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns) {
  const char* base = cache_->slot_ptr(c.slot);
  size_t first = c.piece_begin;
  const uint64_t end = c.file_off + c.span;
  *crc_ns += checksum_range(job, c, base, c.file_off, end, &first);
  if (job.failed()) return "";
  const uint64_t pages_end = c.file_off + c.span / kDirectIoAlign * kDirectIoAlign;
  int errnum = 0;
  std::string err = pwrite_full(job.direct_io_fd(), base, static_cast<size_t>(pages_end - c.file_off), c.file_off,
                                fault, &errnum);
  uint64_t cached_from = pages_end;  // the part written through the page cache
  if (err.empty()) {
    direct_io_bytes_.fetch_add(pages_end - c.file_off, std::memory_order_relaxed);
  } else if (errnum == EINVAL) {
    if (job.refuse_direct_io()) direct_io_refused_.fetch_add(1, std::memory_order_relaxed);
    cached_from = c.file_off;
  } else {
    return err;
  }
  if (cached_from == end) return "";
  err = write_slot_cached(job, c, cached_from, fault, nullptr, crc_ns);  // already checksummed
  if (err.empty() && !job.failed()) start_writeback(job.fd(), cached_from, end - cached_from);
  return err;
}

// The same blocks, read from the pieces' sources; the gaps between pieces stay holes, which read
// as the zeros the slot path writes (the file was empty when opened).
std::string Engine::write_from_sources(FileJob& job, const Chunk& c, FaultKind fault, uint64_t* crc_ns) {
  const bool crc = checksums_.load(std::memory_order_relaxed);
  for (size_t i = c.piece_begin; i < c.piece_end; ++i) {
    const Piece& p = job.pieces()[i];
    for (uint64_t done = 0; done < p.len;) {
      if (job.failed()) return "";
      const uint64_t n = std::min(p.len - done, kFlushBlock);
      if (crc) {
        const uint64_t t0 = now_ns();
        const char* src = p.src + done;
        if (!read_guarded(src, static_cast<size_t>(n), [&] { job.checksum_part(p, src, n); }))
          return source_gone(p);
        *crc_ns += now_ns() - t0;
      }
      std::string err =
          pwrite_full(job.fd(), p.src + done, static_cast<size_t>(n), p.file_off + done, through_page_cache(fault));
      if (!err.empty()) return err;
      done += n;
    }
  }
  return "";
}

// Chains the CRC32C of each piece of chunk c over the bytes of file range [from, to) onto what
// earlier ranges gave (crcs_ starts at 0, the CRC of nothing). Ranges come in file order;
// *first_piece skips the pieces that ended before `from`.
uint64_t Engine::checksum_range(WriteJob& job, const Chunk& c, const char* base, uint64_t from, uint64_t to,
                                size_t* first_piece) const {
  if (!checksums_.load(std::memory_order_relaxed)) return 0;
  const uint64_t t0 = now_ns();
  job.checksum_range(c, base, from, to, first_piece);
  return now_ns() - t0;
}

void Engine::finalize(FileJob& job) {
  try {
    // open_once also covers jobs whose every chunk was empty (header-only files).
    if (!job.failed() && job.open_once()) {
      int rc;
      do {
        rc = ::ftruncate(job.fd(), static_cast<off_t>(job.file_size()));
      } while (rc != 0 && errno == EINTR);
      if (rc != 0) {
        job.fail(job.file_path() + ": ftruncate to " + std::to_string(job.file_size()) + " bytes failed: " + errno_text(errno));
      } else if (job.sync()) {
        const FaultKind fault = faults_.active_for(job.file_path(), bytes_flushed_.load(std::memory_order_relaxed));
        if (fault == FaultKind::kFsyncEio) {
          job.fail(job.file_path() + ": fsync of " + std::to_string(job.file_size()) + " bytes failed: " + errno_text(EIO));
        } else if (::fsync(job.fd()) != 0) {
          job.fail(job.file_path() + ": fsync of " + std::to_string(job.file_size()) + " bytes failed: " + errno_text(errno));
        }
      }
    }
  } catch (const std::exception& e) {
    job.fail(internal_error(job.file_path(), e.what()));
  } catch (...) {
    job.fail(internal_error(job.file_path(), "unknown exception"));
  }
  job.close_file();
  jobs_done_.fetch_add(1, std::memory_order_relaxed);
  if (job.failed()) jobs_failed_.fetch_add(1, std::memory_order_relaxed);
  job.mark_done();
}

// ---------------------------------------------------------------------------------------------

void Engine::read_loop() {
  for (;;) {
    std::shared_ptr<ReadBatch> b;
    {
      std::unique_lock<std::mutex> lk(read_mu_);
      read_cv_.wait(lk, [&] { return !read_q_.empty() || stop_read_; });
      if (read_q_.empty()) return;
      b = std::move(read_q_.front());
      read_q_.pop_front();
    }
    b->run();
  }
}

std::optional<ReadMismatch> Engine::read_into(const std::string& path, const std::vector<ReadRange>& ranges,
                                             const std::vector<ReadCheck>& checks, int threads) {
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].nbytes > 0 && ranges[i].dst == 0)
      throw std::invalid_argument("range " + std::to_string(i) + ": dst_ptr is null for " +
                                  std::to_string(ranges[i].nbytes) + " bytes");
  std::string err;
  int e = 0;
  const int fd = open_regular_for_read(path, &err, &e);  // no symlink, FIFO or device
  if (fd < 0) throw IoError(e, err);
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    throw IoError(e, path + ": fstat failed: " + errno_text(e));
  }
  const uint64_t fsize = static_cast<uint64_t>(st.st_size);
  // Only regular files have a meaningful size; anything else finds out through pread.
  if (S_ISREG(st.st_mode)) {
    for (const ReadRange& r : ranges)
      if (r.file_offset > fsize || r.nbytes > fsize - r.file_offset)
        throw ShortReadError(path + ": short read at offset " + std::to_string(r.file_offset) + ": wanted " +
                             std::to_string(r.nbytes) + " bytes, file has " + std::to_string(fsize));
  }
  const int workers = threads > 0 ? std::min(threads, cfg_.read_threads) : cfg_.read_threads;
  ReadFile file{path, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), fsize};
  auto batch = std::make_shared<ReadBatch>(std::move(file), ranges, checks, chunk_bytes(), static_cast<size_t>(workers),
                                           &bytes_read_);
  if (batch->empty()) return std::nullopt;

  const size_t helpers = batch->groups() - 1;
  if (helpers > 0) {
    std::lock_guard<std::mutex> g(read_mu_);
    if (!stop_read_) {
      for (size_t i = 0; i < helpers; ++i) read_q_.push_back(batch);
    }
  }
  if (helpers > 0) read_cv_.notify_all();
  batch->run();  // the caller works too; after shutdown it does everything alone
  batch->wait_all();
  return batch->result();
}

// ---------------------------------------------------------------------------------------------

void Engine::set_fault(const std::string& kind, uint64_t after_bytes, const std::string& path_substring) {
  faults_.set(parse_fault_kind(kind), after_bytes, path_substring, bytes_flushed_.load());
}

void Engine::stop_threads() {
  cache_->stop_prefault();  // an engine shut down right after start must not fault in GBs first
  // A job never named would keep its parked chunks' slots, and copy workers draining their queue
  // could wait for those slots forever.
  {
    std::lock_guard<std::mutex> g(unnamed_mu_);
    for (auto& w : unnamed_)
      if (auto j = w.lock(); j && j->awaiting_name()) j->fail(j->path() + ": the engine shut down before the file was named");
    unnamed_.clear();
  }
  // Copy workers first: they drain their queue (blocking on slots that flush workers free),
  // then flush workers drain theirs, so every submitted job ends done.
  {
    std::lock_guard<std::mutex> g(copy_mu_);
    stop_copy_ = true;
  }
  copy_cv_.notify_all();
  for (auto& t : copy_threads_) t.join();
  // Copy workers are gone, so no chunk reaches the stager any more: its completion threads
  // drain (every device chunk on to the flush queue) before the flush workers stop.
  if (stager_) stager_->stop();
  {
    std::lock_guard<std::mutex> g(flush_mu_);
    stop_flush_ = true;
  }
  flush_cv_.notify_all();
  for (auto& t : flush_threads_) t.join();
  {
    std::lock_guard<std::mutex> g(read_mu_);
    stop_read_ = true;
  }
  read_cv_.notify_all();
  for (auto& t : read_threads_) t.join();
  copy_threads_.clear();
  flush_threads_.clear();
  read_threads_.clear();
  {
    std::lock_guard<std::mutex> g(read_mu_);
    read_q_.clear();
  }
  // Every copy into the cache is complete: the registration can go.
  pinned_.store(false, std::memory_order_release);
  cache_->unpin();
}

void Engine::shutdown() {
  std::lock_guard<std::mutex> g(shutdown_mu_);
  if (joined_) return;
  shut_down_.store(true, std::memory_order_release);
  stop_threads();
  joined_ = true;
}

EngineStats Engine::stats() const {
  EngineStats s{};
  s.cache_bytes = cache_->bytes();
  s.chunk_bytes = cache_->slot_bytes();
  s.alignment = cache_->alignment();
  s.cache_address = reinterpret_cast<uintptr_t>(cache_->base());
  s.cache_allocations = cache_->allocations();
  s.slots_total = static_cast<uint64_t>(cache_->slots_total());
  s.slots_free = static_cast<uint64_t>(cache_->slots_free());
  s.peak_slots_used = static_cast<uint64_t>(cache_->peak_used());
  s.cache_prefaulted_bytes = cache_->prefaulted_bytes();
  s.bytes_staged = bytes_staged_.load();
  s.bytes_flushed = bytes_flushed_.load();
  s.bytes_read = bytes_read_.load();
  s.chunks_staged = chunks_staged_.load();
  s.chunks_flushed = chunks_flushed_.load();
  s.jobs_submitted = jobs_submitted_.load();
  s.jobs_done = jobs_done_.load();
  s.jobs_failed = jobs_failed_.load();
  s.backpressure_waits = backpressure_waits_.load();
  s.copy_threads = static_cast<uint64_t>(cfg_.copy_threads);
  s.flush_threads = static_cast<uint64_t>(cfg_.flush_threads);
  s.read_threads = static_cast<uint64_t>(cfg_.read_threads);
  s.hw_crc32c = crc32c_hardware_available() ? 1 : 0;
  s.cuda = stager_ ? 1 : 0;
  s.pinned = pinned_.load(std::memory_order_acquire) ? 1 : 0;
  s.d2h_bytes = d2h_bytes_.load();
  s.direct_bytes = direct_bytes_.load();
  s.direct_io_bytes = direct_io_bytes_.load();
  s.direct_io_refused = direct_io_refused_.load();
  s.device_waits = device_waits_.load();
  s.host_waits = host_waits_.load();
  s.flush_ns = flush_ns_.load();
  s.checksum_ns = checksum_ns_.load();
  return s;
}

}  // namespace dcpds
