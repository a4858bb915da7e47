// One parallel read (Engine::read_into): byte ranges of one file into caller memory, with optional
// CRC32C checks of pieces of those ranges, computed right after each pread while the bytes are hot.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcpds {

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

// The bytes [file_offset, file_offset + nbytes) of ranges[range] must have CRC32C `crc`.
struct ReadCheck {
  uint64_t range;
  uint64_t file_offset;
  uint64_t nbytes;
  uint64_t crc;
};

// The first check that failed (read_into returns it; the caller names the item).
struct ReadMismatch {
  uint64_t range;
  uint64_t file_offset;
  uint64_t nbytes;
  uint32_t expected;
  uint32_t found;
};

// The smallest piece of work: contiguous bytes, checked as a whole when `checked`.
struct ReadUnit {
  char* dst;
  uint64_t off;
  uint64_t len;
  uint64_t range;
  uint32_t crc;
  bool checked;
};

// The file read_into opened and checked: workers open it again by path and must find the same
// inode (a save into the same folder replaces files with new ones).
struct ReadFile {
  std::string path;
  uint64_t dev = 0, ino = 0, size = 0;
};

class ReadBatch {
 public:
  // Throws std::invalid_argument for a check outside its range or overlapping another.
  // Units are sorted by file offset and cut into at most `groups` contiguous runs of about equal
  // bytes: each worker then reads one sequential stream with its own descriptor (and readahead).
  ReadBatch(ReadFile file, const std::vector<ReadRange>& ranges, const std::vector<ReadCheck>& checks,
            uint64_t unit_bytes, size_t groups, std::atomic<uint64_t>* bytes_read);

  size_t groups() const { return group_begin_.size() - 1; }
  bool empty() const { return units_.empty(); }

  // Claims groups until none is left (the caller and pool workers all call it).
  void run();
  // Waits until every claimed group is over; workers arriving later do nothing.
  void wait_all();
  // After wait_all: throws IoError / ShortReadError for a failed read, returns the first
  // checksum mismatch, or nothing.
  std::optional<ReadMismatch> result() const;

 private:
  void plan_units(const std::vector<ReadRange>& ranges, const std::vector<ReadCheck>& checks, uint64_t unit_bytes);
  void plan_groups(size_t groups);
  void read_group(size_t g);
  int open_same_file();
  bool read_unit(int fd, const ReadUnit& u);
  void record_error(int err, bool short_read, std::string message);
  void record_mismatch(const ReadUnit& u, uint32_t found);

  const ReadFile file_;
  std::vector<ReadUnit> units_;
  std::vector<size_t> group_begin_;  // group g is units_[group_begin_[g], group_begin_[g + 1])
  std::atomic<size_t> next_group_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t>* bytes_read_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int active_ = 0;
  bool finished_ = false;  // set by the caller; late workers must not touch dst after it
  int err_ = 0;
  bool short_read_ = false;
  std::string message_;
  std::optional<ReadMismatch> mismatch_;
};

}  // namespace dcpds
