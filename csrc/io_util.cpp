#include "io_util.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

namespace dcpds {
namespace {

// strerror_r is the GNU (char*) or the XSI (int) flavour depending on the libc; accept both.
[[maybe_unused]] const char* pick_message(const char* ret, const char*) { return ret; }
[[maybe_unused]] const char* pick_message(int ret, const char* buf) { return ret == 0 ? buf : "unknown error"; }

// Linux moves at most ~2 GiB per read/write call; ask for 1 GiB at a time and loop.
constexpr size_t kMaxIo = size_t(1) << 30;

}  // namespace

std::string errno_text(int err) {
  char buf[256];
  buf[0] = '\0';
  const char* msg = pick_message(strerror_r(err, buf, sizeof buf), buf);
  return std::string(msg) + " (errno " + std::to_string(err) + ")";
}

std::string pwrite_full(int fd, const void* buf, size_t n, uint64_t off, FaultKind fault, int* errnum) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  bool first_call = true;
  if (errnum != nullptr) *errnum = 0;
  auto head = [&] { return "pwrite of " + std::to_string(n) + " bytes at offset " + std::to_string(off); };
  if (fault == FaultKind::kEio || fault == FaultKind::kEnospc || fault == FaultKind::kDirectEinval) {
    const int e = fault == FaultKind::kEio ? EIO : fault == FaultKind::kEnospc ? ENOSPC : EINVAL;
    if (errnum != nullptr) *errnum = e;
    return head() + " failed: " + errno_text(e);
  }
  while (done < n) {
    size_t want = n - done;
    if (want > kMaxIo) want = kMaxIo;
    ssize_t w;
    if (fault == FaultKind::kShortWrite && !first_call) {
      w = 0;  // simulated: the device stops accepting bytes after the first partial write
    } else {
      if (fault == FaultKind::kShortWrite) want = (n - done) / 2;
      w = want == 0 ? 0 : ::pwrite(fd, p + done, want, static_cast<off_t>(off + done));
    }
    first_call = false;
    if (w < 0) {
      int e = errno;
      if (e == EINTR) continue;
      if (errnum != nullptr) *errnum = e;
      return head() + " failed after " + std::to_string(done) + " bytes: " + errno_text(e);
    }
    if (w == 0)
      return "short write: " + head() + " stopped after " + std::to_string(done) +
             " bytes (pwrite returned 0)";
    done += static_cast<size_t>(w);
  }
  return std::string();
}

int pread_full(int fd, void* buf, size_t n, uint64_t off, size_t* got) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    size_t want = n - done;
    if (want > kMaxIo) want = kMaxIo;
    ssize_t r = ::pread(fd, p + done, want, static_cast<off_t>(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      *got = done;
      return errno;
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  *got = done;
  return 0;
}

namespace {

const char* file_kind(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// After an open with O_NOFOLLOW failed with ELOOP (or opened something else): what is there.
std::string kind_message(const std::string& path, const char* what) {
  std::string text = path + ": is " + what + ", not a regular file";
  if (std::strcmp(what, "a symbolic link") == 0) text += " (checkpoint files are never read or written through a link)";
  return text;
}

// The descriptor is a regular file: drop O_NONBLOCK (it was only there so a FIFO cannot block
// the open). Closes fd and returns -1 with *err otherwise.
int keep_if_regular(int fd, const std::string& path, std::string* err, int* errnum, struct stat* st) {
  if (::fstat(fd, st) != 0) {
    const int e = errno;
    ::close(fd);
    *errnum = e;
    *err = path + ": fstat failed: " + errno_text(e);
    return -1;
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    *errnum = S_ISDIR(st->st_mode) ? EISDIR : EINVAL;
    *err = kind_message(path, file_kind(st->st_mode));
    return -1;
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

int open_checked(const std::string& path, int flags, mode_t mode, const char* verb, std::string* err, int* errnum) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) return fd;
  const int e = errno;
  *errnum = e;
  struct stat st;
  if (e == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    *err = kind_message(path, "a symbolic link");
  else if (e == ENXIO && ::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    *err = kind_message(path, file_kind(st.st_mode));  // a FIFO without a reader
  else
    *err = path + ": open for " + verb + " failed: " + errno_text(e);
  return -1;
}

}  // namespace

int open_regular_for_read(const std::string& path, std::string* err, int* errnum) {
  const int fd = open_checked(path, O_RDONLY, 0, "reading", err, errnum);
  if (fd < 0) return -1;
  struct stat st;
  return keep_if_regular(fd, path, err, errnum, &st);
}

int open_regular_for_write(const std::string& path, std::string* err) {
  int errnum = 0;
  // No O_TRUNC here: the file is truncated only once it is known to be a regular file with no
  // other name.
  const int fd = open_checked(path, O_WRONLY | O_CREAT, 0644, "writing", err, &errnum);
  if (fd < 0) return -1;
  struct stat st;
  if (keep_if_regular(fd, path, err, &errnum, &st) < 0) return -1;
  if (st.st_nlink > 1) {
    ::close(fd);
    *err = path + ": has " + std::to_string(st.st_nlink) +
           " hard links; refusing to overwrite a file another name shares (remove it first)";
    return -1;
  }
  if (st.st_size != 0 && ::ftruncate(fd, 0) != 0) {
    const int e = errno;
    ::close(fd);
    *err = path + ": truncating the old file failed: " + errno_text(e);
    return -1;
  }
  return fd;
}

int reopen_for_direct_io(int fd) {
#if defined(__linux__)
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  int d;
  do {
    d = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  } while (d < 0 && errno == EINTR);
  return d;
#else
  (void)fd;
  return -1;
#endif
}

// Starts the disk write of a chunk just written to the page cache, without waiting for it, so the
// file's final fsync finds little left to write: without this the disk idles while the whole file
// sits dirty, and the fsync alone took a large share of the time to durable (issue 26). Only a
// hint: an error here (a file system that cannot do it) changes nothing, the final fsync reports
// real ones.
void start_writeback(int fd, uint64_t off, uint64_t len) {
#if defined(__linux__)
  int rc;
  do {
    rc = ::sync_file_range(fd, static_cast<off64_t>(off), static_cast<off64_t>(len), SYNC_FILE_RANGE_WRITE);
  } while (rc != 0 && errno == EINTR);
#else
  (void)fd, (void)off, (void)len;
#endif
}

bool memory_backed(const std::string& path) {
#if defined(__linux__)
  // The magic numbers of <linux/magic.h>, spelled out so the build needs no kernel headers.
  constexpr unsigned long kTmpfsMagic = 0x01021994UL, kRamfsMagic = 0x858458f6UL;
  std::string p = path.empty() ? std::string(".") : path;
  for (;;) {
    struct statfs sf;
    int rc;
    do {
      rc = ::statfs(p.c_str(), &sf);
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) {
      const auto magic = static_cast<unsigned long>(sf.f_type) & 0xffffffffUL;
      return magic == kTmpfsMagic || magic == kRamfsMagic;
    }
    if (errno != ENOENT && errno != ENOTDIR) return false;
    if (p == "/" || p == ".") return false;  // nothing left to ask (a removed working folder)
    // Not there yet (the save makes the folder later): ask its parent.
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    if (slash == std::string::npos) p = ".";
    else p.resize(slash == 0 ? 1 : slash);
  }
#else
  (void)path;
  return false;
#endif
}

}  // namespace dcpds
