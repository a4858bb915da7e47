#include "io_util.h"

#include <cerrno>
#include <cstring>
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

std::string pwrite_full(int fd, const void* buf, size_t n, uint64_t off, FaultKind fault) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  bool first_call = true;
  auto head = [&] { return "pwrite of " + std::to_string(n) + " bytes at offset " + std::to_string(off); };
  if (fault == FaultKind::kEio || fault == FaultKind::kEnospc)
    return head() + " failed: " + errno_text(fault == FaultKind::kEio ? EIO : ENOSPC);
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

}  // namespace dcpds
