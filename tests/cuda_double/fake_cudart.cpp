// A test double of the CUDA runtime: the entry points dcp_datastates' engine loads, with "device
// memory" being ordinary host memory. What it keeps of CUDA is the ordering model:
//   - each stream is a worker thread running its queue in order (0 = the current device's legacy
//     default stream);
//   - cudaEventRecord enqueues a marker; the event completes when its stream reaches it; a wait
//     (cudaEventSynchronize, cudaStreamWaitEvent) targets the record current at the call;
//   - cudaStreamWaitEvent makes a stream block until that record completes; each record is tracked
//     on its own, so re-recording an event (on any stream) never releases an earlier wait;
//   - events and streams belong to the device current at creation; recording an event on a
//     stream of another device fails (cudaErrorInvalidResourceHandle), as in CUDA.
// Test controls (extern "C", for ctypes): call counters, injected failures and delays, a "kernel"
// that fills memory from a stream, and counts of live handles for leak checks.
//
// Built by tests/test_cuda_double.py:  g++ -std=c++17 -O1 -shared -fPIC -pthread fake_cudart.cpp
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kInvalidDevice = 101;
constexpr int kInvalidHandle = 400;
constexpr int kNotReady = 600;
constexpr int kAlreadyRegistered = 712;
constexpr int kNotRegistered = 713;

struct Event {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  // Each cudaEventRecord is a distinct record, numbered 1, 2, ...; record 0 stands for "never
  // recorded" and counts as complete. Records can complete out of order (an event may be
  // re-recorded on another stream), so completion is tracked per record, not as a high-water mark:
  // every record <= done_prefix is complete, and so is every record in done_rest.
  uint64_t recorded = 0;     // most recent record issued
  uint64_t done_prefix = 0;  // all records 1..done_prefix have completed
  std::set<uint64_t> done_rest;  // completed records above done_prefix

  bool is_done(uint64_t id) const { return id <= done_prefix || done_rest.count(id) != 0; }
  void complete(uint64_t id) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (id > done_prefix) {
        done_rest.insert(id);
        for (auto it = done_rest.begin(); it != done_rest.end() && *it == done_prefix + 1;
             it = done_rest.erase(it))
          ++done_prefix;
      }
    }
    cv.notify_all();
  }
  void wait(uint64_t id) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return is_done(id); });
  }
};

struct Stream {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  uint64_t submitted = 0, executed = 0;
  bool stop = false;

  void push(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> g(mu);
      q.push_back(std::move(op));
      ++submitted;
    }
    cv.notify_all();
  }
  void run() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !q.empty() || stop; });
        if (q.empty()) return;
        op = std::move(q.front());
        q.pop_front();
      }
      op();
      {
        std::lock_guard<std::mutex> g(mu);
        ++executed;
      }
      cv.notify_all();
    }
  }
  void drain() {
    std::unique_lock<std::mutex> lk(mu);
    const uint64_t target = submitted;
    cv.wait(lk, [&] { return executed >= target; });
  }
};

std::shared_ptr<Stream> start_stream(int device) {
  auto s = std::make_shared<Stream>();
  s->device = device;
  std::thread([s] { s->run(); }).detach();  // exits once stopped and drained
  return s;
}

struct Failure {
  long long after = 0;  // calls allowed before failing
  long long calls = 0;  // calls since armed
  int err = 0;
};

struct State {
  std::mutex mu;
  int device_count = 1;
  std::map<void*, std::shared_ptr<Stream>> streams;
  std::map<int, std::shared_ptr<Stream>> legacy;  // per device, created on first use
  std::map<void*, std::shared_ptr<Event>> events;
  std::map<uintptr_t, size_t> registered;  // base -> bytes
  std::map<std::string, long long> counts;
  std::map<std::string, Failure> failures;
  std::map<std::string, long long> delays_us;
};

State& st() {
  static State* s = new State();  // leaked: streams may outlive static destruction
  return *s;
}

thread_local int t_device = 0;

// Counts the call; returns the injected error for it, or kSuccess.
int enter(const char* fn, long long* delay_us = nullptr) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  ++s.counts[fn];
  if (delay_us) {
    auto d = s.delays_us.find(fn);
    *delay_us = d == s.delays_us.end() ? 0 : d->second;
  }
  auto it = s.failures.find(fn);
  if (it == s.failures.end() || it->second.err == 0) return kSuccess;
  return ++it->second.calls > it->second.after ? it->second.err : kSuccess;
}

void sleep_us(long long us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// Resolves a stream handle (0: the legacy stream of the calling thread's device); null if unknown.
std::shared_ptr<Stream> find_stream(void* h) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  if (h == nullptr) {
    auto& l = s.legacy[t_device];
    if (!l) l = start_stream(t_device);
    return l;
  }
  auto it = s.streams.find(h);
  return it == s.streams.end() ? nullptr : it->second;
}

std::shared_ptr<Event> find_event(void* h) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  auto it = s.events.find(h);
  return it == s.events.end() ? nullptr : it->second;
}

}  // namespace

// ------------------------------------------------------------------------------- runtime API

FAKE_API int cudaGetDeviceCount(int* n) {
  if (int e = enter("cudaGetDeviceCount")) return e;
  if (!n) return kInvalidValue;
  std::lock_guard<std::mutex> g(st().mu);
  *n = st().device_count;
  return kSuccess;
}

FAKE_API int cudaSetDevice(int d) {
  if (int e = enter("cudaSetDevice")) return e;
  std::lock_guard<std::mutex> g(st().mu);
  if (d < 0 || d >= st().device_count) return kInvalidDevice;
  t_device = d;
  return kSuccess;
}

FAKE_API int cudaGetDevice(int* d) {
  if (int e = enter("cudaGetDevice")) return e;
  if (!d) return kInvalidValue;
  *d = t_device;
  return kSuccess;
}

FAKE_API int cudaHostRegister(void* p, size_t n, unsigned /*flags*/) {
  long long delay = 0;
  if (int e = enter("cudaHostRegister", &delay)) return e;
  sleep_us(delay);
  if (!p || !n) return kInvalidValue;
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const auto& r : s.registered)
    if (a < r.first + r.second && r.first < a + n) return kAlreadyRegistered;
  s.registered[a] = n;
  return kSuccess;
}

FAKE_API int cudaHostUnregister(void* p) {
  if (int e = enter("cudaHostUnregister")) return e;
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  return s.registered.erase(reinterpret_cast<uintptr_t>(p)) ? kSuccess : kNotRegistered;
}

FAKE_API int cudaStreamCreateWithFlags(void** out, unsigned /*flags*/) {
  if (int e = enter("cudaStreamCreateWithFlags")) return e;
  if (!out) return kInvalidValue;
  auto s = start_stream(t_device);
  std::lock_guard<std::mutex> g(st().mu);
  st().streams[s.get()] = s;
  *out = s.get();
  return kSuccess;
}

FAKE_API int cudaStreamDestroy(void* h) {
  if (int e = enter("cudaStreamDestroy")) return e;
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> g(st().mu);
    auto it = st().streams.find(h);
    if (it == st().streams.end()) return kInvalidHandle;
    s = it->second;
    st().streams.erase(it);
  }
  {
    std::lock_guard<std::mutex> g(s->mu);
    s->stop = true;  // like CUDA: queued work still runs, then the stream goes
  }
  s->cv.notify_all();
  return kSuccess;
}

FAKE_API int cudaEventCreateWithFlags(void** out, unsigned /*flags*/) {
  if (int e = enter("cudaEventCreateWithFlags")) return e;
  if (!out) return kInvalidValue;
  auto ev = std::make_shared<Event>();
  ev->device = t_device;
  std::lock_guard<std::mutex> g(st().mu);
  st().events[ev.get()] = ev;
  *out = ev.get();
  return kSuccess;
}

FAKE_API int cudaEventDestroy(void* h) {
  if (int e = enter("cudaEventDestroy")) return e;
  std::lock_guard<std::mutex> g(st().mu);
  return st().events.erase(h) ? kSuccess : kInvalidHandle;  // pending waits keep their own reference
}

FAKE_API int cudaEventRecord(void* eh, void* sh) {
  if (int e = enter("cudaEventRecord")) return e;
  auto ev = find_event(eh);
  auto s = find_stream(sh);
  if (!ev || !s) return kInvalidHandle;
  if (ev->device != s->device) return kInvalidHandle;
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    target = ++ev->recorded;
  }
  s->push([ev, target] { ev->complete(target); });
  return kSuccess;
}

FAKE_API int cudaEventQuery(void* eh) {
  if (int e = enter("cudaEventQuery")) return e;
  auto ev = find_event(eh);
  if (!ev) return kInvalidHandle;
  std::lock_guard<std::mutex> g(ev->mu);
  return ev->is_done(ev->recorded) ? kSuccess : kNotReady;
}

FAKE_API int cudaEventSynchronize(void* eh) {
  long long delay = 0;
  const int injected = enter("cudaEventSynchronize", &delay);
  auto ev = find_event(eh);
  if (!ev) return kInvalidHandle;
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    target = ev->recorded;
  }
  // An injected failure is reported once the work has run, like an asynchronous CUDA error.
  ev->wait(target);
  sleep_us(delay);
  return injected;
}

FAKE_API int cudaStreamWaitEvent(void* sh, void* eh, unsigned /*flags*/) {
  if (int e = enter("cudaStreamWaitEvent")) return e;
  auto ev = find_event(eh);
  auto s = find_stream(sh);
  if (!ev || !s) return kInvalidHandle;
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(ev->mu);
    target = ev->recorded;
  }
  s->push([ev, target] { ev->wait(target); });
  return kSuccess;
}

FAKE_API int cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* sh) {
  long long delay = 0;
  if (int e = enter("cudaMemcpyAsync", &delay)) return e;
  if (kind < 0 || kind > 4 || (n && (!dst || !src))) return kInvalidValue;
  auto s = find_stream(sh);
  if (!s) return kInvalidHandle;
  {
    State& g = st();
    std::lock_guard<std::mutex> lk(g.mu);
    const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
    for (const auto& r : g.registered)
      if (a >= r.first && a + n <= r.first + r.second) ++g.counts["memcpy_to_pinned"];
  }
  s->push([dst, src, n, delay] {
    sleep_us(delay);
    std::memcpy(dst, src, n);
  });
  return kSuccess;
}

FAKE_API int cudaStreamSynchronize(void* sh) {
  if (int e = enter("cudaStreamSynchronize")) return e;
  auto s = find_stream(sh);
  if (!s) return kInvalidHandle;
  s->drain();
  return kSuccess;
}

FAKE_API const char* cudaGetErrorString(int err) {
  switch (err) {
    case 0: return "no error";
    case 1: return "invalid argument";
    case 2: return "out of memory";
    case 35: return "CUDA driver version is insufficient for CUDA runtime version";
    case 100: return "no CUDA-capable device is detected";
    case 101: return "invalid device ordinal";
    case 400: return "invalid resource handle";
    case 600: return "device not ready";
    case 700: return "an illegal memory access was encountered";
    case 712: return "part or all of the requested memory range is already mapped";
    case 713: return "pointer does not correspond to a registered memory region";
    case 999: return "unknown error";
    default: return "fake CUDA error";
  }
}

// ------------------------------------------------------------------------------ test controls

// Forget counters, failures and delays; set the device count back to 1. Handles stay.
FAKE_API void fake_reset() {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  s.counts.clear();
  s.failures.clear();
  s.delays_us.clear();
  s.device_count = 1;
}

FAKE_API void fake_set_device_count(int n) {
  std::lock_guard<std::mutex> g(st().mu);
  st().device_count = n;
}

// From now on, calls of `fn` after the first `after_calls` return `err` (0 disarms).
FAKE_API void fake_set_fail(const char* fn, long long after_calls, int err) {
  std::lock_guard<std::mutex> g(st().mu);
  st().failures[fn] = Failure{after_calls, 0, err};
}

// cudaMemcpyAsync: each copy sleeps this long on its stream before copying. cudaEventSynchronize
// and cudaHostRegister: the call sleeps this long.
FAKE_API void fake_set_delay_us(const char* fn, long long us) {
  std::lock_guard<std::mutex> g(st().mu);
  st().delays_us[fn] = us;
}

// Calls of `fn` so far; also "memcpy_to_pinned" (copies whose destination lies in a registered
// range) and "fake_launch_fill".
FAKE_API long long fake_count(const char* fn) {
  std::lock_guard<std::mutex> g(st().mu);
  auto it = st().counts.find(fn);
  return it == st().counts.end() ? 0 : it->second;
}

// Live handles: "streams" (created, not destroyed), "events", "registered" ranges.
FAKE_API long long fake_live(const char* what) {
  std::lock_guard<std::mutex> g(st().mu);
  const std::string w = what;
  if (w == "streams") return static_cast<long long>(st().streams.size());
  if (w == "events") return static_cast<long long>(st().events.size());
  if (w == "registered") return static_cast<long long>(st().registered.size());
  return -1;
}

// A "kernel" on `stream`: after delay_us, sets n bytes at ptr to `byte`.
FAKE_API int fake_launch_fill(void* stream, void* ptr, int byte, size_t n, long long delay_us) {
  enter("fake_launch_fill");
  auto s = find_stream(stream);
  if (!s) return kInvalidHandle;
  s->push([ptr, byte, n, delay_us] {
    sleep_us(delay_us);
    std::memset(ptr, byte, n);
  });
  return kSuccess;
}

// Blocks until every op queued on `stream` so far has run (without counting as a runtime call).
FAKE_API int fake_stream_drain(void* stream) {
  auto s = find_stream(stream);
  if (!s) return kInvalidHandle;
  s->drain();
  return kSuccess;
}
