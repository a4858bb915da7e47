#include "write_job.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <unistd.h>

#include "crc32c.h"
#include "engine.h"
#include "grid.h"
#include "host_cache.h"
#include "io_util.h"

namespace dcpds {
namespace {

std::string item_text(size_t i, const WriteItem& it) {
  return "item " + std::to_string(i) + " (src_ptr=" + std::to_string(it.src) + ", nbytes=" +
         std::to_string(it.nbytes) + ", file_offset=" + std::to_string(it.offset) + ")";
}

constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

}  // namespace

WriteJob::WriteJob(std::string path, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
                   uint64_t grid, int device)
    : path_(std::move(path)), header_(std::move(header)), file_size_(file_size), grid_(grid), device_(device) {
  if (grid_ == 0) throw std::invalid_argument("chunk grid must be positive");
  const uint64_t data_start = header_.size();
  if (file_size_ > kMaxOffset) throw std::invalid_argument("file_size " + std::to_string(file_size_) + " is too large");
  if (file_size_ < data_start)
    throw std::invalid_argument("file_size " + std::to_string(file_size_) + " is smaller than the header (" +
                                std::to_string(data_start) + " bytes)");

  // Validate each item against the file bounds, and count its grid pieces.
  const size_t n = items.size();
  crc_begin_.resize(n + 1);
  size_t npieces = 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteItem& it = items[i];
    crc_begin_[i] = npieces;
    if (it.nbytes > kMaxOffset || it.offset > kMaxOffset)
      throw std::invalid_argument(item_text(i, it) + ": value out of range");
    if (it.offset < data_start)
      throw std::invalid_argument(item_text(i, it) + ": file_offset is inside the header (header is " +
                                  std::to_string(data_start) + " bytes)");
    if (it.offset + it.nbytes > file_size_)
      throw std::invalid_argument(item_text(i, it) + ": ends at " + std::to_string(it.offset + it.nbytes) +
                                  ", past file_size " + std::to_string(file_size_));
    if (it.nbytes == 0) continue;
    if (it.segments.empty()) {
      if (it.src == 0) throw std::invalid_argument(item_text(i, it) + ": src_ptr is null");
      if (it.src + it.nbytes < it.src) throw std::invalid_argument(item_text(i, it) + ": source range wraps around");
    } else {
      uint64_t total = 0;
      for (size_t k = 0; k < it.segments.size(); ++k) {
        const SourceSegment& g = it.segments[k];
        if (g.nbytes == 0 || g.src == 0 || g.src + g.nbytes < g.src || g.nbytes > kMaxOffset)
          throw std::invalid_argument(item_text(i, it) + ": source segment " + std::to_string(k) +
                                      " is empty, null or wraps around");
        total += g.nbytes;
      }
      if (total != it.nbytes)
        throw std::invalid_argument(item_text(i, it) + ": source segments hold " + std::to_string(total) +
                                    " bytes, the item " + std::to_string(it.nbytes));
    }
    npieces += grid::piece_count(it.offset, it.nbytes, data_start, grid_);
    nbytes_ += it.nbytes;
  }
  crc_begin_[n] = npieces;

  // Sort non-empty items by offset (the caller may give them in any order) and reject overlaps.
  std::vector<uint32_t> order;
  order.reserve(n);
  if (n > std::numeric_limits<uint32_t>::max()) throw std::invalid_argument("too many items");
  for (size_t i = 0; i < n; ++i)
    if (items[i].nbytes) order.push_back(static_cast<uint32_t>(i));
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return items[a].offset < items[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const WriteItem& prev = items[order[k - 1]];
    const WriteItem& cur = items[order[k]];
    if (prev.offset + prev.nbytes > cur.offset)
      throw std::invalid_argument(item_text(order[k], cur) + " overlaps " + item_text(order[k - 1], prev));
  }

  // Cut on the grid (grid.h); the pieces of one cell form one chunk (one slot, one write).
  pieces_.reserve(npieces);
  crcs_.assign(npieces, 0);
  uint64_t cur_cell = std::numeric_limits<uint64_t>::max();
  for (uint32_t idx : order) {
    const WriteItem& it = items[idx];
    size_t crc_index = crc_begin_[idx];
    size_t seg = 0;         // segmented items: the segment holding the next byte,
    uint64_t seg_pos = 0;   // and how far into it
    grid::for_each_piece(it.offset, it.nbytes, data_start, grid_, [&](uint64_t pos, uint64_t len) {
      const uint64_t cell = grid::cell_of(pos, data_start, grid_);
      const uint64_t stop = pos + len;
      if (cell != cur_cell) {
        Chunk c;
        c.file_off = pos;
        c.piece_begin = pieces_.size();
        c.piece_end = pieces_.size();
        chunks_.push_back(c);
        cur_cell = cell;
      }
      Chunk& c = chunks_.back();
      if (it.segments.empty()) {
        const auto src = static_cast<uintptr_t>(it.src + (pos - it.offset));
        pieces_.push_back(Piece{reinterpret_cast<const char*>(src), len, pos, crc_index});
      } else {
        // One grid piece from several segments: consecutive pieces sharing its checksum, which
        // the flush chains in file order (a grid piece never spans two chunks).
        for (uint64_t done = 0; done < len;) {
          const SourceSegment& g = it.segments[seg];
          const uint64_t take = std::min(len - done, g.nbytes - seg_pos);
          const auto src = static_cast<uintptr_t>(g.src + seg_pos);
          pieces_.push_back(Piece{reinterpret_cast<const char*>(src), take, pos + done, crc_index});
          done += take;
          seg_pos += take;
          if (seg_pos == g.nbytes) ++seg, seg_pos = 0;
        }
      }
      ++crc_index;
      c.piece_end = pieces_.size();
      c.span = stop - c.file_off;
      c.data_bytes += len;
    });
  }
  // A job without data still has to create the file, write the header and set the size:
  // one empty chunk carries it through the pipeline.
  if (chunks_.empty()) chunks_.push_back(Chunk{});
}

void WriteJob::checksum_range(const Chunk& c, const char* base, uint64_t from, uint64_t to, size_t* first_piece) {
  for (size_t i = *first_piece; i < c.piece_end; ++i) {
    const Piece& p = pieces_[i];
    if (p.file_off >= to) break;
    const uint64_t a = std::max(from, p.file_off), b = std::min(to, p.file_off + p.len);
    if (b > a) crcs_[p.crc_index] = crc32c(base + (a - c.file_off), static_cast<size_t>(b - a), crcs_[p.crc_index]);
    if (p.file_off + p.len <= to) *first_piece = i + 1;
  }
}

void WriteJob::checksum_part(const Piece& p, const char* data, uint64_t len) {
  crcs_[p.crc_index] = crc32c(data, static_cast<size_t>(len), crcs_[p.crc_index]);
}

WriteJob::Next WriteJob::next_chunk(double, StreamChunk*) {
  throw std::logic_error(path_ + ": next_chunk on a job that is not streaming");
}

void WriteJob::release(uint64_t) { throw std::logic_error(path_ + ": release on a job that is not streaming"); }

// ---------------------------------------------------------------------------------------------
// File jobs.

FileJob::FileJob(std::string path, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
                 uint64_t grid, bool sync, int device, bool named, bool direct,
                 std::function<void(std::vector<ChunkRef>&&)> requeue, bool direct_io)
    : WriteJob(std::move(path), std::move(header), file_size, items, grid, device),
      sync_(sync),
      direct_(direct),
      want_direct_io_(direct_io),
      file_path_(named ? path_ : std::string()),
      named_(named),
      requeue_(std::move(requeue)) {}

bool FileJob::admit(ChunkRef& ref) {
  std::lock_guard<std::mutex> g(open_mu_);
  if (named_ || failed()) return true;
  parked_.push_back(std::move(ref));
  return false;
}

void FileJob::set_destination(const std::string& path) {
  {
    std::lock_guard<std::mutex> g(open_mu_);
    if (named_) throw std::logic_error(path_ + ": the job's file is named already (" + file_path_ + ")");
    if (path.empty()) throw std::invalid_argument(path_ + ": set_destination needs a path");
    file_path_ = path;
    named_ = true;
    // Still under open_mu_: a flush worker admits no chunk of this job before the parked ones
    // are back at the head of the queue.
    requeue_parked_locked();
  }
}

void FileJob::fail(const std::string& msg) {
  WriteJob::fail(msg);
  std::lock_guard<std::mutex> g(open_mu_);
  requeue_parked_locked();  // admit() lets every later chunk through now: they are dropped
}

bool FileJob::awaiting_name() const {
  std::lock_guard<std::mutex> g(open_mu_);
  return !named_ && !failed();
}

// Under open_mu_ (the engine takes flush_mu_ inside it; no flush worker holds flush_mu_ while it
// takes open_mu_).
void FileJob::requeue_parked_locked() {
  if (parked_.empty()) return;
  std::vector<ChunkRef> parked;
  parked.swap(parked_);
  std::sort(parked.begin(), parked.end(), [](const ChunkRef& a, const ChunkRef& b) { return a.index < b.index; });
  requeue_(std::move(parked));
}

FileJob::~FileJob() {
  // Only reachable if a job is dropped unfinished (engine failure).
  if (fd_ >= 0) ::close(fd_);
  if (direct_io_fd_ >= 0) ::close(direct_io_fd_);
}

bool FileJob::open_once() {
  std::lock_guard<std::mutex> g(open_mu_);
  if (!open_attempted_) {
    open_attempted_ = true;
    std::string err;
    const int fd = open_regular_for_write(file_path_, &err);  // no symlink, FIFO or shared inode
    if (fd < 0) {
      WriteJob::fail(err);  // (not FileJob::fail: it takes open_mu_, held here; nothing is parked once named)
      return false;
    }
    fd_ = fd;
    // Refused (tmpfs before Linux 6.6, some network file systems): written through fd_.
    if (want_direct_io_) direct_io_fd_ = reopen_for_direct_io(fd);
    // The header goes first, before any data chunk of this job.
    if (!header_.empty() && !failed()) {
      std::string werr = pwrite_full(fd, header_.data(), header_.size(), 0);
      if (!werr.empty()) WriteJob::fail(file_path_ + ": writing the header: " + werr);
    }
  }
  return fd_ >= 0 && !failed();
}

void FileJob::close_file() {
  std::lock_guard<std::mutex> g(open_mu_);
  if (direct_io_fd_ >= 0) {
    // (Its writes are durable only with fd_'s fsync, made before this; errors show there.)
    ::close(direct_io_fd_);
    direct_io_fd_ = -1;
  }
  if (fd_ >= 0) {
    // No retry on EINTR: Linux always releases the descriptor.
    if (::close(fd_) != 0 && !failed()) WriteJob::fail(file_path_ + ": close failed: " + errno_text(errno));
    fd_ = -1;
  }
}

bool WriteJob::wait_for(const bool& flag, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] { return flag; };
  if (timeout_s < 0 || timeout_s > 1e9) {
    cv_.wait(lk, ready);
    return true;
  }
  auto d = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  return cv_.wait_for(lk, d, ready);
}

bool WriteJob::wait_staged(double timeout_s) { return wait_for(staged_, timeout_s); }
bool WriteJob::wait_done(double timeout_s) { return wait_for(done_, timeout_s); }

bool WriteJob::is_staged() const {
  std::lock_guard<std::mutex> g(mu_);
  return staged_;
}

bool WriteJob::is_done() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

std::optional<std::string> WriteJob::error() const {
  std::lock_guard<std::mutex> g(mu_);
  if (error_.empty()) return std::nullopt;
  return error_;
}

std::vector<std::vector<uint32_t>> WriteJob::checksums() const {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!done_) throw std::runtime_error(path_ + ": checksums are not available before the write is done");
    if (!error_.empty()) throw std::runtime_error(path_ + ": write failed, no checksums: " + error_);
  }
  const size_t n = crc_begin_.size() - 1;
  std::vector<std::vector<uint32_t>> out(n);
  for (size_t i = 0; i < n; ++i) out[i].assign(crcs_.begin() + crc_begin_[i], crcs_.begin() + crc_begin_[i + 1]);
  return out;
}

void WriteJob::fail(const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (error_.empty()) error_ = msg.empty() ? path_ + ": unknown error" : msg;
    failed_.store(true, std::memory_order_release);
  }
  cv_.notify_all();  // wait_written returns on a failure
}

void WriteJob::chunk_written(size_t index) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (chunk_written_.empty()) chunk_written_.assign(chunks_.size(), 0);
    chunk_written_[index] = 1;
    while (first_unwritten_ < chunks_.size() && chunk_written_[first_unwritten_]) ++first_unwritten_;
  }
  cv_.notify_all();
}

// Under mu_. Chunks are in file order (the constructor cuts the sorted items on the grid), and
// the header is written before any chunk (FileJob::open_once). The prefix ends where the last
// chunk of the written run ends, not where the next begins: bytes past the file's end so far
// would read short.
static uint64_t prefix_of(const std::vector<Chunk>& chunks, size_t first_unwritten, bool done, uint64_t file_size) {
  if (done) return file_size;
  if (first_unwritten == 0) return 0;
  const Chunk& last = chunks[first_unwritten - 1];
  return last.file_off + last.span;
}

uint64_t WriteJob::written_prefix() const {
  std::lock_guard<std::mutex> g(mu_);
  return prefix_of(chunks_, first_unwritten_, done_ && !failed(), file_size_);
}

uint64_t WriteJob::wait_written(uint64_t at_least, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto prefix = [&] { return prefix_of(chunks_, first_unwritten_, done_ && !failed(), file_size_); };
  auto ready = [&] { return done_ || failed() || prefix() >= at_least; };
  if (timeout_s < 0 || timeout_s > 1e9) {
    cv_.wait(lk, ready);
  } else {
    cv_.wait_for(lk, std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(timeout_s)), ready);
  }
  return prefix();
}

void WriteJob::abort(const std::string& msg) {
  fail(msg.empty() ? path_ + ": aborted" : msg);
  // File jobs wind down through the workers, which check failed() at every step.
}

bool WriteJob::chunk_staged() {
  if (chunks_staged_.fetch_add(1, std::memory_order_acq_rel) + 1 != chunks_.size()) return false;
  {
    std::lock_guard<std::mutex> g(mu_);
    staged_ = true;
  }
  cv_.notify_all();
  return true;
}

bool WriteJob::chunk_flushed() {
  return chunks_flushed_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks_.size();
}

void WriteJob::mark_done() {
  {
    std::lock_guard<std::mutex> g(mu_);
    staged_ = true;
    done_ = true;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// Streaming jobs. Chunks reach kReady in any order (several flush workers), the consumer takes
// them strictly in file order. Deadlock freedom rests on the engine granting cache slots in
// copy-queue order (Engine::copy_loop): chunk k holds a slot, or is first in line for one,
// before any later chunk of any job gets one, so the consumer's next chunk always arrives.

namespace {

// The zeros a streaming job hands out for gaps and the tail (read-only, shared by every job).
const char kZeros[1 << 20] = {};

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

StreamJob::StreamJob(std::string label, std::string header, uint64_t file_size, const std::vector<WriteItem>& items,
                     uint64_t grid, int device, HostCache* cache, Engine* engine)
    : WriteJob(std::move(label), std::move(header), file_size, items, grid, device), cache_(cache), engine_(engine),
      cstate_(chunks_.size(), ChunkState::kPending) {}

void StreamJob::fail(const std::string& msg) {
  WriteJob::fail(msg);
  // Chunks waiting for the consumer will never be taken; give their slots back (and wake a
  // consumer waiting in next_chunk). Handed-out chunks stay the consumer's until release.
  drop_held(false);
}

WriteJob::Next StreamJob::next_chunk(double timeout_s, StreamChunk* out) {
  std::unique_lock<std::mutex> lk(smu_);
  const size_t n = cstate_.size();
  // Where the bytes handed out so far must reach before the next data chunk (or the end).
  auto boundary = [&] { return next_ < n ? chunks_[next_].file_off : file_size_; };
  auto ready = [&] {
    while (next_ < n && cstate_[next_] == ChunkState::kFinished) ++next_;  // empty or dropped
    return failed() || handed_ < boundary() || next_ == n || cstate_[next_] == ChunkState::kReady;
  };
  if (timeout_s < 0 || timeout_s > 1e9) {
    scv_.wait(lk, ready);
  } else if (!scv_.wait_for(lk, seconds(timeout_s), ready)) {
    return Next::kTimeout;
  }
  if (failed()) return Next::kEnd;
  if (handed_ < boundary()) {  // the header, a gap or the tail: bytes no slot holds
    const uint64_t stop = boundary();
    out->file_offset = handed_;
    if (handed_ < header_.size()) {
      out->ptr = header_.data() + handed_;
      out->nbytes = std::min<uint64_t>(header_.size(), stop) - handed_;
    } else {
      out->ptr = kZeros;
      out->nbytes = std::min<uint64_t>(stop - handed_, sizeof(kZeros));
    }
    fills_out_.insert(handed_);
    handed_ += out->nbytes;
    return Next::kChunk;
  }
  if (next_ == n) return Next::kEnd;
  const Chunk& c = chunks_[next_];
  cstate_[next_] = ChunkState::kTaken;
  ++held_;
  ++next_;
  out->file_offset = c.file_off;
  out->ptr = cache_->slot_ptr(c.slot);
  out->nbytes = c.span;
  handed_ = c.file_off + c.span;
  return Next::kChunk;
}

void StreamJob::release(uint64_t file_offset) {
  std::unique_lock<std::mutex> lk(smu_);
  if (fills_out_.erase(file_offset) != 0) return;  // header or zeros: nothing to give back
  auto it = std::lower_bound(chunks_.begin(), chunks_.end(), file_offset,
                             [](const Chunk& c, uint64_t off) { return c.file_off < off; });
  const size_t i = static_cast<size_t>(it - chunks_.begin());
  if (it == chunks_.end() || it->file_off != file_offset || it->span == 0 || cstate_[i] != ChunkState::kTaken)
    throw std::invalid_argument(path_ + ": release(" + std::to_string(file_offset) +
                                "): no chunk handed out by next_chunk and not yet released starts there");
  cache_->release(it->slot);
  it->slot = -1;
  --held_;
  const uint64_t bytes = it->data_bytes;
  add_bytes_done(bytes);
  const bool last = finish_locked(i);
  lk.unlock();
  if (engine_) engine_->note_stream_release(bytes);
  if (last) complete();
}

void StreamJob::abort(const std::string& msg) {
  fail(msg.empty() ? path_ + ": aborted" : msg);
  drop_held(true);
}

size_t StreamJob::chunks_held() const {
  std::lock_guard<std::mutex> g(smu_);
  return held_;
}

void StreamJob::chunk_ready(size_t index) {
  bool last = false;
  {
    std::lock_guard<std::mutex> g(smu_);
    if (failed()) {  // fail() may have run drop_held already: nobody else frees this slot
      Chunk& c = chunks_[index];
      if (c.slot >= 0) cache_->release(c.slot);
      c.slot = -1;
      last = finish_locked(index);
    } else {
      cstate_[index] = ChunkState::kReady;
    }
  }
  scv_.notify_all();
  if (last) complete();
}

void StreamJob::chunk_drop(size_t index) {
  bool last;
  {
    std::lock_guard<std::mutex> g(smu_);
    Chunk& c = chunks_[index];
    if (c.slot >= 0) cache_->release(c.slot);
    c.slot = -1;
    last = finish_locked(index);
  }
  scv_.notify_all();
  if (last) complete();
}

void StreamJob::drop_held(bool taken) {
  bool last = false;
  {
    std::lock_guard<std::mutex> g(smu_);
    for (size_t i = 0; i < cstate_.size(); ++i) {
      const ChunkState s = cstate_[i];
      if (s != ChunkState::kReady && !(taken && s == ChunkState::kTaken)) continue;
      if (s == ChunkState::kTaken) --held_;
      Chunk& c = chunks_[i];
      if (c.slot >= 0) cache_->release(c.slot);
      c.slot = -1;
      last = finish_locked(i) || last;
    }
  }
  scv_.notify_all();
  if (last) complete();
}

bool StreamJob::finish_locked(size_t index) {
  cstate_[index] = ChunkState::kFinished;
  return ++finished_ == cstate_.size();
}

void StreamJob::complete() {
  if (engine_) engine_->note_job_done(failed());  // counted before waiters see the job done
  mark_done();
}

}  // namespace dcpds
