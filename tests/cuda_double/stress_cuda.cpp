// Stress driver for the engine's CUDA path against the runtime double (no Python): concurrent
// device and host jobs on a tiny cache, caller-stream "kernels" that must be ordered before the
// copies, device waits followed by writes that must not reach the files, random injected CUDA
// failures and delays, shutdown while busy. Built and run by tests/sanitize.sh
// under ThreadSanitizer and AddressSanitizer+UBSan. Usage: stress_cuda <path of the double>.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "tests/stress_check.h"

using namespace dcpds;
using stress::g_failures;
using stress::read_file;

namespace {

struct Fake {
  void (*reset)();
  void (*set_fail)(const char*, long long, int);
  void (*set_delay_us)(const char*, long long);
  long long (*live)(const char*);
  int (*fill)(void*, void*, int, size_t, long long);
  int (*drain)(void*);
  int (*stream_create)(void**, unsigned);
  int (*stream_destroy)(void*);
};

template <typename F>
void sym(void* h, const char* name, F*& out) {
  out = reinterpret_cast<F*>(dlsym(h, name));
  if (!out) {
    std::fprintf(stderr, "double has no %s\n", name);
    std::exit(2);
  }
}

struct Planned {
  std::string path;
  std::vector<char> src;   // "device memory"
  std::string expected;    // what the file must hold when the job succeeds
  std::shared_ptr<WriteJob> job;
};

void run_phase(const std::string& dir, const Fake& fake, int phase, bool faults) {
  fake.reset();
  fake.set_delay_us("cudaMemcpyAsync", 50);
  EngineConfig cfg;
  cfg.cache_bytes = 128 * 1024;
  cfg.chunk_bytes = 8192;
  cfg.copy_threads = 3;
  cfg.flush_threads = 2;
  cfg.read_threads = 2;
  cfg.cache_wait_timeout_s = 600;
  cfg.alignment = 4096;
  cfg.pin = true;
  cfg.prefault = true;
  auto eng = std::make_unique<Engine>(cfg);
  CHECK(eng->cuda_mode(), "engine not in CUDA mode: %s", eng->cuda_status().c_str());
  CHECK(eng->stats().pinned == 1, "cache not pinned");

  std::atomic<bool> stop_faults{false};
  std::thread fault_thread([&] {
    std::mt19937_64 rng(77 + phase);
    const char* fns[] = {"cudaMemcpyAsync", "cudaEventSynchronize", "cudaStreamWaitEvent"};
    while (faults && !stop_faults.load()) {
      const char* fn = fns[rng() % 3];
      fake.set_fail(fn, static_cast<long long>(rng() % 20), 700);
      std::this_thread::sleep_for(std::chrono::microseconds(300 + rng() % 3000));
      fake.set_fail(fn, 0, 0);
      std::this_thread::sleep_for(std::chrono::microseconds(300 + rng() % 3000));
    }
  });

  const int submitters = 3, jobs_each = 20;
  std::vector<std::vector<Planned>> all(submitters);
  std::vector<std::thread> threads;
  for (int s = 0; s < submitters; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937_64 rng(phase * 1000 + s);
      void* stream = nullptr;
      fake.stream_create(&stream, 1);
      for (int j = 0; j < jobs_each; ++j) {
        Planned p;
        p.path = dir + "/g" + std::to_string(phase) + "_" + std::to_string(s) + "_" + std::to_string(j) + ".bin";
        const size_t n = 1 + rng() % 40000;
        p.src.assign(n, 0);
        const bool device = rng() % 4 != 0;
        const char value = static_cast<char>(1 + rng() % 200);
        if (device) {
          // The caller's stream produces the bytes just before submit.
          fake.fill(stream, p.src.data(), value, n, static_cast<long long>(rng() % 2000));
        } else {
          std::memset(p.src.data(), value, n);
        }
        const std::string header(rng() % 100, 'H');
        p.expected = header + std::string(n, value);
        std::vector<WriteItem> items{WriteItem{reinterpret_cast<uintptr_t>(p.src.data()), n, header.size()}};
        p.job = eng->submit_write(p.path, header, header.size() + n, items, false, device ? 0 : -1,
                                  reinterpret_cast<uintptr_t>(stream));
        if (device && rng() % 2) {
          // "optimizer.step()": after a device wait (or a host wait), overwrite the source.
          if (!eng->device_wait(*p.job, reinterpret_cast<uintptr_t>(stream))) p.job->wait_staged(-1);
          fake.fill(stream, p.src.data(), 0, n, 0);
        }
        all[s].push_back(std::move(p));
      }
      fake.drain(stream);
      for (auto& p : all[s]) p.job->wait_staged(-1);  // sources stay valid until staged
      fake.stream_destroy(stream);
    });
  }
  for (auto& t : threads) t.join();
  stop_faults = true;
  fault_thread.join();
  fake.set_fail("cudaMemcpyAsync", 0, 0);
  fake.set_fail("cudaEventSynchronize", 0, 0);
  fake.set_fail("cudaStreamWaitEvent", 0, 0);

  // More device jobs, then shut down with them in flight.
  std::vector<Planned> tail(4);
  for (size_t k = 0; k < tail.size(); ++k) {
    Planned& p = tail[k];
    p.path = dir + "/tail" + std::to_string(phase) + "_" + std::to_string(k) + ".bin";
    p.src.assign(30000 + k, static_cast<char>(k + 1));
    p.expected.assign(p.src.begin(), p.src.end());
    p.job = eng->submit_write(p.path, "", p.src.size(), {WriteItem{reinterpret_cast<uintptr_t>(p.src.data()), p.src.size(), 0}},
                              false, 0, 0);
  }
  eng->shutdown();
  EngineStats st = eng->stats();
  CHECK(st.slots_free == st.slots_total, "slots leaked");
  CHECK(st.jobs_done == st.jobs_submitted, "jobs_done %llu != jobs_submitted %llu", (unsigned long long)st.jobs_done,
        (unsigned long long)st.jobs_submitted);
  CHECK(st.pinned == 0, "still pinned after shutdown");
  CHECK(fake.live("streams") == 0 && fake.live("events") == 0 && fake.live("registered") == 0,
        "CUDA handles leaked: %lld streams, %lld events, %lld registrations", fake.live("streams"), fake.live("events"),
        fake.live("registered"));
  eng.reset();

  size_t failed = 0, total = 0;
  auto verify = [&](Planned& p) {
    ++total;
    CHECK(p.job->is_done(), "%s not done", p.path.c_str());
    if (auto err = p.job->error()) {
      ++failed;
      CHECK(err->rfind(p.path + ": ", 0) == 0, "error does not name the path: %s", err->c_str());
      return;
    }
    CHECK(read_file(p.path) == p.expected, "%s: bytes differ", p.path.c_str());
  };
  for (auto& v : all)
    for (auto& p : v) verify(p);
  for (auto& p : tail) {
    verify(p);
    CHECK(!p.job->error(), "tail job failed: %s", p.job->error()->c_str());
  }
  if (!faults) CHECK(failed == 0, "%zu jobs failed without injected faults", failed);
  std::printf("cuda phase %d: %zu jobs, %zu failed (faults=%d), device waits %llu, host waits %llu\n", phase, total,
              failed, faults ? 1 : 0, (unsigned long long)st.device_waits, (unsigned long long)st.host_waits);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <libfake_cudart.so>\n", argv[0]);
    return 2;
  }
  setenv(kCudartEnv, argv[1], 1);
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  Fake fake;
  sym(h, "fake_reset", fake.reset);
  sym(h, "fake_set_fail", fake.set_fail);
  sym(h, "fake_set_delay_us", fake.set_delay_us);
  sym(h, "fake_live", fake.live);
  sym(h, "fake_launch_fill", fake.fill);
  sym(h, "fake_stream_drain", fake.drain);
  sym(h, "cudaStreamCreateWithFlags", fake.stream_create);
  sym(h, "cudaStreamDestroy", fake.stream_destroy);

  char tmpl[] = "/tmp/dcpds_stress_cuda_XXXXXX";
  if (!mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 2;
  }
  const std::string dir = tmpl;
  run_phase(dir, fake, 1, false);  // every job must succeed, bytes exact
  run_phase(dir, fake, 2, true);   // random CUDA failures: failed jobs say so, the rest are exact
  std::string cmd = "rm -rf '" + dir + "'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "warning: could not remove %s\n", dir.c_str());
  if (g_failures.load()) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("stress_cuda: OK\n");
  return 0;
}
