// One data file to write: the caller's layout (header + items at given offsets) cut into chunks
// on a fixed grid, plus the job's progress, error and per-piece checksums.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"

namespace dcpds {

class DeviceStager;
class Engine;
class HostCache;

// One item as given by the caller: bytes [src, src + nbytes) go to file offset `offset`.
struct WriteItem {
  uint64_t src;
  uint64_t nbytes;
  uint64_t offset;
};

// The part of one item that falls inside one grid chunk; it gets its own CRC32C.
struct Piece {
  const char* src;
  uint64_t len;
  uint64_t file_off;
  size_t crc_index;  // into WriteJob::crcs_
};

// A run of pieces inside one grid cell, written with a single pwrite from one cache slot.
// The write covers [file_off, file_off + span): from the first piece to the end of the last;
// gaps between pieces are zero-filled (the same bytes ftruncate would leave there).
struct Chunk {
  uint64_t file_off = 0;
  uint64_t span = 0;
  uint64_t data_bytes = 0;  // sum of piece lengths
  size_t piece_begin = 0;
  size_t piece_end = 0;
  int slot = -1;  // set by the copy worker, cleared by the flush worker
};

class WriteJob;

// A piece of a streaming job's file handed to its consumer: `nbytes` bytes at `ptr` (a cache
// slot, the job's header, or zeros) belong at `file_offset`; pieces come back to back.
struct StreamChunk {
  uint64_t file_offset;
  const char* ptr;
  uint64_t nbytes;
};

// One chunk of one job, as it travels through the copy, completion and flush queues.
struct ChunkRef {
  std::shared_ptr<WriteJob> job;
  size_t index;
};

class WriteJob {
 public:
  // Validates the layout and cuts it on a grid of `grid` bytes starting at header.size().
  // Throws std::invalid_argument naming the offending item.
  // stream: a streaming job (Engine::submit_stream): nothing is written to `path` (a label for
  // messages); each chunk, once copied and checksummed, waits in its slot for the consumer
  // (next_chunk / release) instead of being pwritten.
  WriteJob(std::string path, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
           uint64_t grid, bool sync, int device, bool stream = false);
  WriteJob(const WriteJob&) = delete;
  WriteJob& operator=(const WriteJob&) = delete;
  ~WriteJob();

  const std::string& path() const { return path_; }
  uint64_t nbytes() const { return nbytes_; }
  size_t nchunks() const { return chunks_.size(); }
  uint64_t piece_size() const { return grid_; }
  uint64_t file_size() const { return file_size_; }
  // -1: the sources are host memory; d >= 0: device pointers on CUDA device d.
  int device() const { return device_; }

  // Wait for the state; timeout_s < 0 waits forever. True once reached (a failed job reaches both).
  bool wait_staged(double timeout_s);
  bool wait_done(double timeout_s);
  bool is_staged() const;
  bool is_done() const;
  // True once every chunk's copy has been issued: done for host sources, queued on the copy
  // stream for device sources (chunks of a failed job count once skipped).
  bool all_enqueued() const { return chunks_enqueued_.load(std::memory_order_acquire) == chunks_.size(); }
  std::optional<std::string> error() const;
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  // CRC32C of each piece, per item in the order given. Throws std::runtime_error unless the
  // job is done without error.
  std::vector<std::vector<uint32_t>> checksums() const;

  // ---- streaming jobs (stream() true); the others throw std::logic_error.
  bool stream() const { return stream_; }
  enum class Next { kChunk, kEnd, kTimeout };
  // The next piece of the file in order, so that the consumer only appends: the header, zeros
  // for a gap or the tail (no slot: the engine writes every byte of every file, local or not),
  // or a data chunk once it is in the cache and checksummed; waits up to timeout_s (negative:
  // forever). kEnd when the whole file was handed out or the job failed (see error()). A data
  // chunk's slot stays borrowed until release(chunk.file_offset) or until the job is aborted;
  // releasing a header or zero piece is accepted and gives nothing back.
  Next next_chunk(double timeout_s, StreamChunk* out);
  // Gives back the slot of a chunk next_chunk returned. Throws std::invalid_argument when no
  // chunk handed out and not yet released starts at file_offset.
  void release(uint64_t file_offset);
  // Fails the job with `msg` (the first error wins) at once, for any job. Streaming jobs give
  // back every slot they hold, the consumer's included (it must not touch a chunk's memory after
  // calling this). File jobs stop where they are: copy workers skip their remaining chunks (a
  // worker waiting for a cache slot for one gives up), flush workers drop their chunks between
  // two blocks and give the slots back, and the job is done (waiters wake) as soon as no worker
  // touches it any more, normally within milliseconds. The file is left incomplete.
  void abort(const std::string& msg);
  // Data bytes durable so far: written to the file (file jobs; synced only once done) or
  // handed to and released by the consumer (streaming jobs).
  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_acquire); }
  // Chunks handed out and not released (for tests).
  size_t chunks_held() const;

 private:
  friend class DeviceStager;
  friend class Engine;

  // Records the first error; later chunks of the job are skipped.
  void fail(const std::string& msg);
  bool chunk_staged();       // marks the job staged after its last chunk; true for that call
  void chunk_enqueued() { chunks_enqueued_.fetch_add(1, std::memory_order_acq_rel); }
  bool chunk_flushed();      // true for the caller that flushed the last chunk
  void mark_done();
  bool wait_for(const bool& flag, double timeout_s);

  // Streaming: the engine's flush worker hands a checksummed chunk (slot held) to the consumer,
  // or drops it (failed job, no slot, empty chunk). Both give the slot back when the job failed.
  void stream_ready(size_t index);
  void stream_drop(size_t index);
  // Gives back the slots of chunks waiting for the consumer (and with `taken`, of handed-out ones
  // too); the job must have failed. Wakes the consumer.
  void stream_drop_held(bool taken);
  // Marks chunk `index` finished (slot already given back); the caller holds smu_. True when it
  // was the job's last.
  bool stream_finish_locked(size_t index);
  void stream_complete();  // after the last chunk finished: done, engine counters

  const std::string path_;
  const std::string header_;
  const uint64_t file_size_;
  const uint64_t grid_;
  const bool sync_;
  const int device_;
  uint64_t nbytes_ = 0;

  std::vector<Chunk> chunks_;
  std::vector<Piece> pieces_;
  std::vector<uint32_t> crcs_;        // each element written by exactly one flush worker
  std::vector<size_t> crc_begin_;     // item i (given order) owns crcs_[crc_begin_[i], crc_begin_[i+1])

  std::atomic<size_t> chunks_enqueued_{0};
  std::atomic<size_t> chunks_staged_{0};
  std::atomic<size_t> chunks_flushed_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> bytes_done_{0};

  // The file is opened and the header written once, by the first flush of the job.
  std::mutex open_mu_;
  bool open_attempted_ = false;
  int fd_ = -1;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool staged_ = false;
  bool done_ = false;
  std::string error_;

  // Device jobs (DeviceStager). entry_event_ is recorded on the caller's stream at submit and
  // handed back once the copy stream waits on it (guarded by the device's enqueue mutex).
  // last_event_ follows the job's last copy on the copy stream, for device_wait; it is given
  // back once the job is staged.
  CudaEvent entry_event_ = nullptr;
  std::mutex cuda_mu_;  // guards last_event_
  CudaEvent last_event_ = nullptr;

  // Streaming state (stream_ only). Each chunk goes kPending -> kReady (in its slot, checksummed)
  // -> kTaken (handed to the consumer) -> kFinished (slot given back), or straight to kFinished.
  enum class ChunkState : uint8_t { kPending, kReady, kTaken, kFinished };
  const bool stream_ = false;
  HostCache* cache_ = nullptr;  // set by the engine at submit; outlives the job's use
  Engine* engine_ = nullptr;
  mutable std::mutex smu_;  // lock order: d.mu (DeviceStager) -> mu_ released -> smu_ -> cache
  std::condition_variable scv_;
  std::vector<ChunkState> cstate_;
  size_t next_ = 0;       // first chunk not yet handed out
  uint64_t handed_ = 0;   // bytes [0, handed_) of the file handed out, in order
  std::set<uint64_t> fills_out_;  // offsets of header/zero pieces handed out and not released
  size_t finished_ = 0;   // chunks in kFinished
  size_t held_ = 0;       // chunks in kTaken
};

}  // namespace dcpds
