#include "read_batch.h"

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "io_util.h"

namespace dcpds {

namespace {

// Each pread is at most this long and is checksummed right after, while its bytes are still in
// the CPU caches (a second pass over a whole tensor would read it back from memory).
// (1 MiB: 256 KiB to 16 MiB measured the same on /dev/shm, within noise.)
constexpr uint64_t kSliceBytes = uint64_t(1) << 20;

// A worker (a wake-up and an open) for less than this costs more than it saves.
constexpr uint64_t kMinGroupBytes = uint64_t(1) << 20;

std::string range_text(uint64_t off, uint64_t len) {
  return "[" + std::to_string(off) + ", " + std::to_string(off + len) + ")";
}

// Unchecked bytes [off, end) of range r, cut into units of at most unit_bytes.
void add_plain_units(std::vector<ReadUnit>& out, const ReadRange& r, uint64_t range, uint64_t off, uint64_t end,
                     uint64_t unit_bytes) {
  for (uint64_t pos = off; pos < end; pos += unit_bytes) {
    char* dst = reinterpret_cast<char*>(static_cast<uintptr_t>(r.dst + (pos - r.file_offset)));
    out.push_back(ReadUnit{dst, pos, std::min(unit_bytes, end - pos), range, 0, false});
  }
}

}  // namespace

ReadBatch::ReadBatch(ReadFile file, const std::vector<ReadRange>& ranges, const std::vector<ReadCheck>& checks,
                     uint64_t unit_bytes, size_t groups, std::atomic<uint64_t>* bytes_read)
    : file_(std::move(file)), bytes_read_(bytes_read) {
  plan_units(ranges, checks, std::max<uint64_t>(unit_bytes, 1));
  plan_groups(std::max<size_t>(groups, 1));
}

void ReadBatch::plan_units(const std::vector<ReadRange>& ranges, const std::vector<ReadCheck>& checks,
                           uint64_t unit_bytes) {
  std::vector<ReadCheck> sorted(checks);
  std::sort(sorted.begin(), sorted.end(), [](const ReadCheck& a, const ReadCheck& b) {
    return a.range != b.range ? a.range < b.range : a.file_offset < b.file_offset;
  });
  size_t c = 0;
  for (uint64_t i = 0; i < ranges.size(); ++i) {
    const ReadRange& r = ranges[i];
    uint64_t pos = r.file_offset;
    const uint64_t end = r.file_offset + r.nbytes;
    for (; c < sorted.size() && sorted[c].range == i; ++c) {
      const ReadCheck& k = sorted[c];
      if (k.file_offset < pos || k.nbytes > end - k.file_offset || k.file_offset > end || k.nbytes == 0)
        throw std::invalid_argument("check of bytes " + range_text(k.file_offset, k.nbytes) + " for range " +
                                    std::to_string(i) + " " + range_text(r.file_offset, r.nbytes) +
                                    ": empty, outside the range or overlapping another check");
      add_plain_units(units_, r, i, pos, k.file_offset, unit_bytes);
      char* dst = reinterpret_cast<char*>(static_cast<uintptr_t>(r.dst + (k.file_offset - r.file_offset)));
      units_.push_back(ReadUnit{dst, k.file_offset, k.nbytes, i, static_cast<uint32_t>(k.crc), true});
      pos = k.file_offset + k.nbytes;
    }
    add_plain_units(units_, r, i, pos, end, unit_bytes);
  }
  if (c < sorted.size())
    throw std::invalid_argument("check of bytes " + range_text(sorted[c].file_offset, sorted[c].nbytes) +
                                " names range " + std::to_string(sorted[c].range) + " of " +
                                std::to_string(ranges.size()));
  std::stable_sort(units_.begin(), units_.end(), [](const ReadUnit& a, const ReadUnit& b) { return a.off < b.off; });
}

void ReadBatch::plan_groups(size_t groups) {
  uint64_t total = 0;
  for (const ReadUnit& u : units_) total += u.len;
  groups = std::min<size_t>({groups, units_.size(), static_cast<size_t>(std::max<uint64_t>(total / kMinGroupBytes, 1))});
  group_begin_.assign(1, 0);
  if (groups == 0) return;
  uint64_t acc = 0;
  for (size_t i = 0; i < units_.size() && group_begin_.size() < groups; ++i) {
    acc += units_[i].len;
    // Cut once this group holds its share of the bytes (integer math: no overflow below 2^63).
    if (acc >= total / groups * group_begin_.size() && i + 1 < units_.size()) group_begin_.push_back(i + 1);
  }
  group_begin_.push_back(units_.size());
}

void ReadBatch::run() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (finished_) return;
    ++active_;
  }
  while (!failed_.load(std::memory_order_acquire)) {
    const size_t g = next_group_.fetch_add(1, std::memory_order_relaxed);
    if (g >= groups()) break;
    read_group(g);
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    --active_;
  }
  cv_.notify_all();
}

// A new descriptor (its own file position and readahead state) for the file read_into checked;
// -1 after recording why not.
int ReadBatch::open_same_file() {
  std::string err;
  int e = 0;
  const int fd = open_regular_for_read(file_.path, &err, &e);  // the same checks as read_into's open
  if (fd < 0) {
    record_error(e, false, err);
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != file_.dev ||
      static_cast<uint64_t>(st.st_ino) != file_.ino) {
    ::close(fd);
    record_error(ESTALE, false, file_.path + ": the file was replaced while it was being read");
    return -1;
  }
  return fd;
}

// One group: its own descriptor, so the kernel sees one sequential stream per worker.
void ReadBatch::read_group(size_t g) {
  const int fd = open_same_file();
  if (fd < 0) return;
  for (size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
    if (failed_.load(std::memory_order_acquire) || !read_unit(fd, units_[i])) break;
  }
  ::close(fd);
}

// Reads one unit slice by slice, checksumming each slice while it is hot. False on failure.
bool ReadBatch::read_unit(int fd, const ReadUnit& u) {
  uint32_t crc = 0;
  for (uint64_t done = 0; done < u.len;) {
    const size_t want = static_cast<size_t>(std::min(kSliceBytes, u.len - done));
    size_t got = 0;
    const int e = pread_full(fd, u.dst + done, want, u.off + done, &got);
    bytes_read_->fetch_add(got, std::memory_order_relaxed);
    if (e != 0) {
      record_error(e, false, file_.path + ": pread of " + std::to_string(u.len) + " bytes at offset " +
                                 std::to_string(u.off) + " failed: " + errno_text(e));
      return false;
    }
    if (got < want) {  // the file shrank after read_into checked its size
      const uint64_t at = u.off + done + got;
      record_error(0, true, file_.path + ": short read at offset " + std::to_string(at) + ": wanted " +
                                std::to_string(u.off + u.len - at) + " bytes, file has " + std::to_string(file_.size));
      return false;
    }
    if (u.checked) crc = crc32c(u.dst + done, want, crc);
    done += want;
  }
  if (u.checked && crc != u.crc) {
    record_mismatch(u, crc);
    return false;
  }
  return true;
}

void ReadBatch::record_error(int err, bool short_read, std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  if (!failed_.load(std::memory_order_relaxed)) {
    err_ = err;
    short_read_ = short_read;
    message_ = std::move(message);
  }
  failed_.store(true, std::memory_order_release);
}

void ReadBatch::record_mismatch(const ReadUnit& u, uint32_t found) {
  std::lock_guard<std::mutex> g(mu_);
  if (!failed_.load(std::memory_order_relaxed)) mismatch_ = ReadMismatch{u.range, u.off, u.len, u.crc, found};
  failed_.store(true, std::memory_order_release);
}

void ReadBatch::wait_all() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] {
    return active_ == 0 && (failed_.load(std::memory_order_acquire) || next_group_.load() >= groups());
  });
  finished_ = true;
}

std::optional<ReadMismatch> ReadBatch::result() const {
  std::lock_guard<std::mutex> g(mu_);
  if (!failed_.load() || mismatch_) return mismatch_;
  if (short_read_) throw ShortReadError(message_);
  throw IoError(err_, message_);
}

}  // namespace dcpds
