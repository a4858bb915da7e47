// One data file to write: the caller's layout (header + items at given offsets) cut into chunks
// on the checksum grid (grid.h), plus the job's progress, error and per-piece checksums. A
// FileJob is written to a local file by the engine; a StreamJob's bytes go to a consumer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"

namespace dcpds {

class Engine;
class HostCache;

// One piece of an item's source memory, when the item is gathered from several places.
struct SourceSegment {
  uint64_t src;
  uint64_t nbytes;
};

// One item as given by the caller: bytes [src, src + nbytes) go to file offset `offset`. With
// `segments`, the item's bytes are those segments back to back instead (their lengths sum to
// nbytes; src is ignored): a file laid out anew from memory that holds its items in pieces (a
// held file's chunks in the cache). Checksums are per item piece on the grid all the same.
struct WriteItem {
  uint64_t src;
  uint64_t nbytes;
  uint64_t offset;
  std::vector<SourceSegment> segments = {};
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

// What every job has: the layout cut on the grid, progress, the first error, the checksums and
// the device events. The engine and the device stager drive a job through its "engine side"
// methods; FileJob and StreamJob add what differs: where the bytes go.
class WriteJob {
 public:
  // Validates the layout and cuts it on a grid of `grid` bytes starting at header.size().
  // Throws std::invalid_argument naming the offending item.
  WriteJob(std::string path, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
           uint64_t grid, int device);
  WriteJob(const WriteJob&) = delete;
  WriteJob& operator=(const WriteJob&) = delete;
  virtual ~WriteJob() = default;

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

  // A streaming job (StreamJob); the streaming calls below throw std::logic_error otherwise.
  virtual bool stream() const { return false; }
  enum class Next { kChunk, kEnd, kTimeout };
  virtual Next next_chunk(double timeout_s, StreamChunk* out);
  virtual void release(uint64_t file_offset);
  // Chunks handed out and not released (for tests); 0 for file jobs.
  virtual size_t chunks_held() const { return 0; }
  // Fails the job with `msg` (the first error wins) at once. File jobs stop where they are:
  // copy workers skip their remaining chunks (a worker waiting for a cache slot for one gives
  // up), flush workers drop their chunks between two blocks and give the slots back, and the job
  // is done (waiters wake) as soon as no worker touches it any more, normally within
  // milliseconds; the file is left incomplete. StreamJob also gives back every slot it holds.
  virtual void abort(const std::string& msg);
  // Data bytes durable so far: written to the file (file jobs; synced only once done) or
  // handed to and released by the consumer (streaming jobs).
  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_acquire); }
  // File jobs: bytes [0, written_prefix()) of the file hold their final contents (not yet
  // synced): the header and every chunk up to the first one not yet written, the zeros between
  // them included; file_size() once the job is done. What lets a reader copy the file while the
  // engine still writes it (the local tier's drain). 0 before the first chunk is written.
  uint64_t written_prefix() const;
  // Waits until written_prefix() >= at_least, the job fails or is done, or timeout_s passes
  // (< 0: forever); returns written_prefix().
  uint64_t wait_written(uint64_t at_least, double timeout_s);

  // ---- the engine's side (Engine and DeviceStager drive the job through these)
  Chunk& chunk(size_t index) { return chunks_[index]; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  // Chains the CRC32C of each piece of chunk c over the bytes of file range [from, to) (at
  // `base`, the chunk's slot) onto what earlier ranges gave. Ranges come in file order;
  // *first_piece skips the pieces that ended before `from`.
  void checksum_range(const Chunk& c, const char* base, uint64_t from, uint64_t to, size_t* first_piece);
  // Chains the CRC32C of `len` bytes at `data`, the next bytes of piece p in file order, onto
  // what its earlier bytes gave (direct file jobs checksum from the source, piece by piece).
  void checksum_part(const Piece& p, const char* data, uint64_t len);
  // True for a file job written straight from its sources (FileJob, `direct`).
  virtual bool direct() const { return false; }
  // Records the first error; later chunks of the job are skipped.
  virtual void fail(const std::string& msg);
  void chunk_enqueued() { chunks_enqueued_.fetch_add(1, std::memory_order_acq_rel); }
  size_t chunks_enqueued() const { return chunks_enqueued_.load(std::memory_order_relaxed); }
  // Flush workers writing a chunk of this job now (Engine::pop_flush prefers a file nobody writes).
  std::atomic<int>& writers() { return writers_; }
  bool chunk_staged();   // marks the job staged after its last chunk; true for that call
  bool chunk_flushed();  // true for the caller that flushed the last chunk
  // File jobs: chunk `index` is in the file (pwritten); advances written_prefix().
  void chunk_written(size_t index);
  void add_bytes_done(uint64_t n) { bytes_done_.fetch_add(n, std::memory_order_acq_rel); }
  void mark_done();
  // Device jobs (DeviceStager). The entry event is recorded on the caller's stream at submit and
  // handed back once the copy stream waits on it (guarded by the device's enqueue mutex). The
  // last event follows the job's last copy on the copy stream, for device_wait; it is given back
  // once the job is staged (guarded by cuda_mutex()).
  CudaEvent& entry_event() { return entry_event_; }
  std::mutex& cuda_mutex() { return cuda_mu_; }
  CudaEvent& last_event() { return last_event_; }

 protected:
  const std::string path_;
  const std::string header_;
  const uint64_t file_size_;
  const uint64_t grid_;
  const int device_;
  uint64_t nbytes_ = 0;

  std::vector<Chunk> chunks_;
  std::vector<Piece> pieces_;
  std::vector<uint32_t> crcs_;        // each element written by exactly one flush worker
  std::vector<size_t> crc_begin_;     // item i (given order) owns crcs_[crc_begin_[i], crc_begin_[i+1])

 private:
  bool wait_for(const bool& flag, double timeout_s);

  std::atomic<size_t> chunks_enqueued_{0};
  std::atomic<size_t> chunks_staged_{0};
  std::atomic<size_t> chunks_flushed_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<int> writers_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool staged_ = false;
  bool done_ = false;
  std::vector<char> chunk_written_;  // per chunk: pwritten (sized on first use)
  size_t first_unwritten_ = 0;       // chunks [0, first_unwritten_) are all written
  std::string error_;

  CudaEvent entry_event_ = nullptr;
  std::mutex cuda_mu_;
  CudaEvent last_event_ = nullptr;
};

// A data file the engine writes itself (Engine::submit_write): the first flush opens it and
// writes the header, every chunk is pwritten at its offset (gaps inside a chunk are zeros in
// its slot), the last one truncates it to file_size (the zero tail) and fsyncs it with `sync`.
//
// A job may be submitted before its file can be named (`named` false): the caller's folder work
// then runs off the training thread while the copies go on. `path` is only a label for messages
// until set_destination names the file; flush workers park the job's chunks (slots held) until
// then, and a failure hands them back so that their slots are freed.
//
// A `direct` job (host sources only) takes no cache slot: its chunks go straight to the flush
// queue and each is pwritten from the caller's memory, checksummed there block by block, gaps
// left as holes (zeros: the file starts empty). One pass over memory instead of two, for files on
// memory-backed file systems, where the write is itself a memory copy and the cache's copy first
// doubles the work. The job is staged once its last chunk is written, not copied: the sources
// must stay unchanged until then, as for any job until it is staged.
class FileJob final : public WriteJob {
 public:
  // `requeue` puts the parked chunks back at the head of the engine's flush queue, ahead of the
  // job's later chunks queued meanwhile, in file order and in one step: flushed in any other
  // order, the written prefix (what the local tier's drain may copy) would stall behind them.
  FileJob(std::string path, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
          uint64_t grid, bool sync, int device, bool named, bool direct,
          std::function<void(std::vector<ChunkRef>&&)> requeue, bool direct_io = false);
  ~FileJob() override;

  bool sync() const { return sync_; }
  bool direct() const override { return direct_; }
  // The file written: `path`, or the one set_destination named. Read by flush workers only for
  // chunks that admit() let through (set before, under open_mu_).
  const std::string& file_path() const { return file_path_; }
  // Flush side: true when chunk `ref` may be written now (named, or failed: then it is dropped);
  // otherwise the job keeps it until set_destination or a failure.
  bool admit(ChunkRef& ref);
  // Names the file of a job submitted unnamed; the parked chunks go back to the flush queue.
  // Throws std::logic_error if the job has a name already.
  void set_destination(const std::string& path);
  // Also hands the parked chunks back, so the flush workers drop them and free their slots.
  void fail(const std::string& msg) override;
  // True while the job waits for its name (neither named nor failed).
  bool awaiting_name() const;
  // Opens the file (no symlink, FIFO or shared inode) and writes the header, the first time;
  // false when the job failed (then or before).
  bool open_once();
  // The descriptor open_once opened (-1 before).
  int fd() const { return fd_; }
  // The same file opened for O_DIRECT writes by open_once, for a synced job whose engine asks
  // for it and whose file system accepts it; -1 otherwise (every write then goes through fd()).
  int direct_io_fd() const { return direct_io_fd_; }
  // The file system refused an O_DIRECT write (EINVAL): the job's chunks go through fd() from now
  // on (direct_io_fd stays open until close_file for writes already under way). True the first time.
  bool refuse_direct_io() { return !direct_io_refused_.exchange(true); }
  bool direct_io_refused() const { return direct_io_refused_.load(std::memory_order_relaxed); }
  // Closes the descriptor; a failure fails the job.
  void close_file();

 private:
  void requeue_parked_locked();

  const bool sync_;
  const bool direct_;
  const bool want_direct_io_;
  mutable std::mutex open_mu_;
  bool open_attempted_ = false;
  int fd_ = -1;
  int direct_io_fd_ = -1;
  std::atomic<bool> direct_io_refused_{false};
  std::string file_path_;  // guarded by open_mu_ until named_
  bool named_;             // guarded by open_mu_
  std::vector<ChunkRef> parked_;  // guarded by open_mu_
  const std::function<void(std::vector<ChunkRef>&&)> requeue_;
};

// A data file handed to a consumer instead (Engine::submit_stream): each chunk, once copied and
// checksummed, waits in its slot until the consumer takes it (next_chunk, in file order, with
// the header and zeros between) and gives it back (release). Nothing is written to `path`: it
// names the file in messages (a URL).
class StreamJob final : public WriteJob {
 public:
  StreamJob(std::string label, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
            uint64_t grid, int device, HostCache* cache, Engine* engine);

  bool stream() const override { return true; }
  // The next piece of the file in order, so that the consumer only appends: the header, zeros
  // for a gap or the tail (no slot: the engine makes every byte of every file, local or not),
  // or a data chunk once it is in the cache and checksummed; waits up to timeout_s (negative:
  // forever). kEnd when the whole file was handed out or the job failed (see error()). A data
  // chunk's slot stays borrowed until release(chunk.file_offset) or until the job is aborted;
  // releasing a header or zero piece is accepted and gives nothing back.
  Next next_chunk(double timeout_s, StreamChunk* out) override;
  // Gives back the slot of a chunk next_chunk returned. Throws std::invalid_argument when no
  // piece handed out and not yet released starts at file_offset.
  void release(uint64_t file_offset) override;
  size_t chunks_held() const override;
  // Also gives back every slot the job holds, the consumer's included (it must not touch a
  // chunk's memory after calling this).
  void abort(const std::string& msg) override;
  // Also gives back the slots of chunks waiting for the consumer, and wakes it.
  void fail(const std::string& msg) override;

  // ---- the engine's side: chunk `index` is checksummed in its slot (ready for the consumer),
  // or dropped (failed job, no slot, empty chunk). Both give the slot back when the job failed.
  void chunk_ready(size_t index);
  void chunk_drop(size_t index);

 private:
  // Gives back the slots of chunks waiting for the consumer (and with `taken`, of handed-out
  // ones too); the job must have failed. Wakes the consumer.
  void drop_held(bool taken);
  // Marks chunk `index` finished (slot already given back); the caller holds smu_. True when it
  // was the job's last.
  bool finish_locked(size_t index);
  void complete();  // after the last chunk finished: done, engine counters

  // Each chunk goes kPending -> kReady (in its slot, checksummed) -> kTaken (handed to the
  // consumer) -> kFinished (slot given back), or straight to kFinished.
  enum class ChunkState : uint8_t { kPending, kReady, kTaken, kFinished };
  HostCache* const cache_;  // outlives the job's use
  Engine* const engine_;
  mutable std::mutex smu_;  // lock order: d.mu (DeviceStager) -> WriteJob::mu_ released -> smu_ -> cache
  std::condition_variable scv_;
  std::vector<ChunkState> cstate_;
  size_t next_ = 0;       // first chunk not yet handed out
  uint64_t handed_ = 0;   // bytes [0, handed_) of the file handed out, in order
  std::set<uint64_t> fills_out_;  // offsets of header/zero pieces handed out and not released
  size_t finished_ = 0;   // chunks in kFinished
  size_t held_ = 0;       // chunks in kTaken
};

}  // namespace dcpds
