// Standalone stress driver for the engine (no Python): many concurrent jobs against a small cache
// with random fault injection, cache-wait timeouts, concurrent reads and shutdown while busy.
// Built by tests/sanitize.sh under ThreadSanitizer and AddressSanitizer+UBSan.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "engine.h"
#include "tests/stress_check.h"

using namespace dcpds;
using stress::g_failures;
using stress::read_file;

namespace {

// One planned file: header, sources, expected bytes.
struct Planned {
  std::string path;
  std::string header;
  std::vector<std::vector<char>> sources;
  std::vector<WriteItem> items;  // in the order submitted (shuffled)
  std::vector<size_t> item_array;  // items[k] comes from sources[item_array[k]]
  std::string expected;
  std::shared_ptr<WriteJob> job;
};

Planned plan(std::mt19937_64& rng, const std::string& path) {
  Planned p;
  p.path = path;
  p.header.assign(rng() % 300, 'H');
  size_t nitems = 1 + rng() % 40;
  uint64_t pos = p.header.size();
  p.sources.resize(nitems);
  std::vector<uint64_t> offsets(nitems);
  for (size_t i = 0; i < nitems; ++i) {
    size_t n = (rng() % 4 == 0) ? rng() % 150000 : rng() % 300;
    if (rng() % 10 == 0) n = 0;
    p.sources[i].resize(n);
    for (auto& c : p.sources[i]) c = static_cast<char>(rng());
    pos += (rng() % 5 == 0) ? rng() % 5000 : 0;  // occasional gap
    offsets[i] = pos;
    pos += n;
  }
  uint64_t file_size = pos + ((rng() % 8 == 0) ? rng() % 100 : 0);
  p.expected.assign(file_size, '\0');
  std::memcpy(&p.expected[0], p.header.data(), p.header.size());
  for (size_t i = 0; i < nitems; ++i)
    if (!p.sources[i].empty()) std::memcpy(&p.expected[offsets[i]], p.sources[i].data(), p.sources[i].size());
  std::vector<size_t> order(nitems);
  for (size_t i = 0; i < nitems; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) {
    uint64_t src = p.sources[i].empty() ? 0 : reinterpret_cast<uintptr_t>(p.sources[i].data());
    p.items.push_back(WriteItem{src, p.sources[i].size(), offsets[i]});
    p.item_array.push_back(i);
  }
  return p;
}

// The job's per-piece CRCs against the portable implementation over the expected file: one
// CRC per grid cell (origin: the end of the header) each item touches.
void check_checksums(const Planned& p, uint64_t grid) {
  auto crcs = p.job->checksums();
  const uint64_t ds = p.header.size();
  for (size_t k = 0; k < p.items.size(); ++k) {
    const WriteItem& it = p.items[k];
    std::vector<uint32_t> want;
    for (uint64_t pos = it.offset, end = it.offset + it.nbytes; pos < end;) {
      uint64_t stop = std::min(end, ds + ((pos - ds) / grid + 1) * grid);
      want.push_back(crc32c_software(p.expected.data() + pos, stop - pos));
      pos = stop;
    }
    CHECK(crcs[k] == want, "%s: item %zu checksums differ", p.path.c_str(), k);
  }
}

// The stress engines: tiny 8 KiB slots so a few MiB of jobs cycle the cache many times.
EngineConfig stress_config(uint64_t cache_bytes, int read_threads, double cache_wait_timeout) {
  EngineConfig cfg;
  cfg.cache_bytes = static_cast<int64_t>(cache_bytes);
  cfg.chunk_bytes = 8192;
  cfg.alignment = 4096;
  cfg.copy_threads = 3;
  cfg.flush_threads = 2;
  cfg.read_threads = read_threads;
  cfg.cache_wait_timeout_s = cache_wait_timeout;
  cfg.pin = false;
  cfg.prefault = false;
  return cfg;
}

void verify(Planned& p, uint64_t grid) {
  CHECK(p.job->wait_done(60), "%s not done", p.path.c_str());
  CHECK(p.job->is_staged(), "%s done but not staged", p.path.c_str());
  auto err = p.job->error();
  if (err) {
    CHECK(err->rfind(p.path + ": ", 0) == 0, "error does not name the path: %s", err->c_str());
    bool threw = false;
    try {
      p.job->checksums();
    } catch (const std::runtime_error&) {
      threw = true;
    }
    CHECK(threw, "checksums of a failed job must throw");
    return;
  }
  std::string got = read_file(p.path);
  CHECK(got == p.expected, "%s: bytes differ (size %zu vs %zu)", p.path.c_str(), got.size(), p.expected.size());
  check_checksums(p, grid);
}

void run_phase(const std::string& dir, int phase, double cache_wait_timeout, bool faults) {
  auto eng = std::make_unique<Engine>(stress_config(64 * 1024, 3, cache_wait_timeout));
  const uint64_t grid = eng->chunk_bytes();

  std::atomic<bool> stop_faults{false};
  std::thread fault_thread([&] {
    std::mt19937_64 rng(1000 + phase);
    const char* kinds[] = {"none", "eio", "enospc", "short_write", "fsync_eio", "direct_einval", "none", "none"};
    while (faults && !stop_faults.load()) {
      std::string sub = (rng() % 2) ? "" : ("_" + std::to_string(rng() % 4) + "_");
      eng->set_fault(kinds[rng() % 8], rng() % 200000, sub);
      std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 2000));
    }
  });

  const int submitters = 3, jobs_each = 25;
  std::vector<std::vector<Planned>> all(submitters);
  std::vector<std::thread> threads;
  // Jobs submitted unnamed (j % 6 in 1, 4, 5) are named after a random delay by a thread of
  // their own, or (5) failed before they ever are: parked chunks must be written, or dropped with
  // their slots freed, while other jobs wait for slots.
  std::mutex namers_mu;
  std::vector<std::thread> namers;
  for (int s = 0; s < submitters; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937_64 rng(phase * 100 + s);
      for (int j = 0; j < jobs_each; ++j) {
        Planned p = plan(rng, dir + "/p" + std::to_string(phase) + "_" + std::to_string(s) + "_" + std::to_string(j % 4) +
                                  "_" + std::to_string(j) + ".bin");
        const int mode = j % 6;
        const bool named = !(mode == 1 || mode == 4 || mode == 5);
        // A third written straight from the sources (no cache slot), among jobs that wait for slots.
        const bool direct = rng() % 3 == 0;
        // Half synced; half of those past the page cache (O_DIRECT where the file system takes it).
        const bool sync = rng() % 2 == 0;
        const bool direct_io = sync && rng() % 2 == 0;
        p.job = eng->submit_write(p.path, p.header, p.expected.size(), p.items, sync, -1, 0, named, direct, direct_io);
        if (!named) {
          const auto delay = std::chrono::microseconds(rng() % 3000);
          std::lock_guard<std::mutex> g(namers_mu);
          namers.emplace_back([job = p.job, path = p.path, mode, delay] {
            std::this_thread::sleep_for(delay);
            if (mode == 5) job->abort(path + ": stress: abandoned before its file was named");
            else static_cast<FileJob&>(*job).set_destination(path);
          });
        }
        all[s].push_back(std::move(p));
        if (j % 5 == 4) all[s][all[s].size() - 2].job->wait_staged(-1);
      }
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (auto& t : namers) t.join();

  // Read finished files back in parallel while later jobs are still writing.
  for (int s = 0; s < submitters; ++s) {
    threads.emplace_back([&, s] {
      for (auto& p : all[s]) {
        p.job->wait_done(-1);
        if (p.job->error()) continue;
        std::vector<char> buf(p.expected.size() + 1);
        std::vector<ReadRange> ranges;
        if (!p.expected.empty()) ranges.push_back(ReadRange{reinterpret_cast<uintptr_t>(buf.data()), 0, p.expected.size()});
        try {
          eng->read_into(p.path, ranges);
          CHECK(std::memcmp(buf.data(), p.expected.data(), p.expected.size()) == 0, "read back differs: %s",
                p.path.c_str());
        } catch (const std::exception& e) {
          CHECK(false, "read_into threw: %s", e.what());
        }
        bool short_thrown = false;
        try {
          eng->read_into(p.path, {ReadRange{reinterpret_cast<uintptr_t>(buf.data()), 0, p.expected.size() + 1}});
        } catch (const ShortReadError&) {
          short_thrown = true;
        }
        CHECK(short_thrown, "no short read error for %s", p.path.c_str());
      }
    });
  }
  for (auto& t : threads) t.join();

  stop_faults = true;
  fault_thread.join();
  eng->set_fault("none", 0, "");

  // A few more jobs, then shut down with them in flight: shutdown must drain them.
  std::mt19937_64 rng(phase * 7 + 3);
  std::vector<Planned> tail;
  for (int j = 0; j < 6; ++j) {
    Planned p = plan(rng, dir + "/tail" + std::to_string(phase) + "_" + std::to_string(j) + ".bin");
    p.job = eng->submit_write(p.path, p.header, p.expected.size(), p.items, false);
    tail.push_back(std::move(p));
  }
  {  // one never named: shutdown fails it and frees its parked chunks' slots
    Planned p = plan(rng, dir + "/tail" + std::to_string(phase) + "_unnamed.bin");
    p.job = eng->submit_write(p.path, p.header, p.expected.size(), p.items, false, -1, 0, false);
    tail.push_back(std::move(p));
  }
  std::thread other([&] { eng->shutdown(); });
  eng->shutdown();
  other.join();
  for (auto& p : tail) CHECK(p.job->is_done(), "shutdown did not drain %s", p.path.c_str());
  bool threw = false;
  try {
    eng->submit_write(dir + "/late.bin", "", 0, {}, false);
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "engine is shut down";
  }
  CHECK(threw, "submit after shutdown must throw");

  EngineStats st = eng->stats();
  CHECK(st.slots_free == st.slots_total, "slots leaked: %llu of %llu free", (unsigned long long)st.slots_free,
        (unsigned long long)st.slots_total);
  CHECK(st.jobs_done == st.jobs_submitted, "jobs_done %llu != jobs_submitted %llu", (unsigned long long)st.jobs_done,
        (unsigned long long)st.jobs_submitted);
  eng.reset();  // jobs outlive the engine

  size_t failed = 0, total = 0, abandoned = 0;
  for (auto& v : all)
    for (auto& p : v) {
      verify(p, grid);
      const bool dropped = p.job->error() && p.job->error()->find("abandoned before its file was named") != std::string::npos;
      abandoned += dropped ? 1 : 0;
      failed += p.job->error() && !dropped ? 1 : 0;
      ++total;
    }
  for (auto& p : tail) {
    verify(p, grid);  // with a tiny cache_wait_timeout a tail job may fail, but must say so
    const bool unnamed = p.path.find("_unnamed") != std::string::npos;
    // A job never named fails at shutdown, saying why; with a tiny cache_wait_timeout its copy
    // worker may give up on a slot first (a loaded machine), which is an error that says so too.
    if (unnamed)
      CHECK(p.job->error() && (p.job->error()->find("before the file was named") != std::string::npos ||
                               (cache_wait_timeout < 1 && p.job->error()->find("host cache full") != std::string::npos)),
            "a job never named must fail at shutdown, saying why: %s",
            p.job->error() ? p.job->error()->c_str() : "no error");
    else if (cache_wait_timeout > 1) CHECK(!p.job->error(), "tail job failed: %s", p.job->error()->c_str());
  }
  CHECK(abandoned > 0, "no job was abandoned unnamed");
  std::printf("phase %d: %zu jobs, %zu failed (faults=%d, cache_wait_timeout=%g s), backpressure waits %llu, "
              "%zu abandoned unnamed\n",
              phase, total, failed, faults ? 1 : 0, cache_wait_timeout, (unsigned long long)st.backpressure_waits,
              abandoned);
}

// Streaming jobs (submit_stream) through a 3-slot cache: a consumer thread per job takes chunks
// in file order with random delays, some consumers abort midway, file jobs are interleaved, and
// (phase with a tiny cache_wait_timeout) copies time out. Every job must end done, successful
// streams must reassemble to the expected bytes with the right checksums, and no slot may leak.
void run_stream_phase(const std::string& dir, int phase, double cache_wait_timeout, bool aborts) {
  auto eng = std::make_unique<Engine>(stress_config(3 * 8192, 1, cache_wait_timeout));
  const uint64_t grid = eng->chunk_bytes();

  struct Streamed {
    Planned p;
    std::string got;
    bool aborted = false;
    bool stream = true;
  };
  const int submitters = 3, jobs_each = 12;
  std::vector<std::vector<std::unique_ptr<Streamed>>> all(submitters);
  std::vector<std::thread> consumers[submitters];
  std::vector<std::thread> threads;
  for (int s = 0; s < submitters; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937_64 rng(phase * 1000 + s);
      for (int j = 0; j < jobs_each; ++j) {
        auto st = std::make_unique<Streamed>();
        st->p = plan(rng, dir + "/s" + std::to_string(phase) + "_" + std::to_string(s) + "_" + std::to_string(j));
        if (rng() % 4 == 0) {  // an ordinary file job in between
          st->stream = false;
          st->p.job = eng->submit_write(st->p.path, st->p.header, st->p.expected.size(), st->p.items, false);
          all[s].push_back(std::move(st));
          continue;
        }
        st->p.job = eng->submit_stream(st->p.path, st->p.header, st->p.expected.size(), st->p.items);
        const int abort_at = (aborts && rng() % 3 == 0) ? static_cast<int>(rng() % 6) : -1;
        Streamed* raw = st.get();
        const uint64_t seed = rng();
        consumers[s].emplace_back([raw, abort_at, seed] {
          std::mt19937_64 r(seed);
          WriteJob& job = *raw->p.job;
          std::string& out = raw->got;
          out.clear();  // the engine hands out every byte: header, chunks, zeros
          StreamChunk c{};
          for (int k = 0;; ++k) {
            if (k == abort_at) {
              raw->aborted = true;
              job.abort(raw->p.path + ": consumer aborted");
              break;
            }
            if (job.next_chunk(-1, &c) != WriteJob::Next::kChunk) break;
            CHECK(c.file_offset == out.size(), "%s: piece at %llu out of order (expected %zu)", raw->p.path.c_str(),
                  (unsigned long long)c.file_offset, out.size());
            out.append(c.ptr, c.nbytes);
            if (r() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(r() % 500));
            job.release(c.file_offset);
          }
          if (!raw->aborted && !job.failed())
            CHECK(out.size() == raw->p.expected.size(), "%s: %zu bytes handed out, the file has %zu", raw->p.path.c_str(),
                  out.size(), raw->p.expected.size());
        });
        all[s].push_back(std::move(st));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& v : consumers)
    for (auto& t : v) t.join();
  eng->shutdown();
  EngineStats st = eng->stats();
  CHECK(st.slots_free == st.slots_total, "stream phase: slots leaked: %llu of %llu free",
        (unsigned long long)st.slots_free, (unsigned long long)st.slots_total);
  CHECK(st.jobs_done == st.jobs_submitted, "stream phase: jobs_done %llu != jobs_submitted %llu",
        (unsigned long long)st.jobs_done, (unsigned long long)st.jobs_submitted);
  eng.reset();  // jobs outlive the engine

  size_t failed = 0, total = 0, aborted = 0;
  for (auto& v : all)
    for (auto& sp : v) {
      Planned& p = sp->p;
      ++total;
      if (!sp->stream) {
        verify(p, grid);
        failed += p.job->error() ? 1 : 0;
        continue;
      }
      CHECK(p.job->wait_done(10), "%s: stream not done", p.path.c_str());
      CHECK(p.job->chunks_held() == 0, "%s: chunks still held", p.path.c_str());
      aborted += sp->aborted ? 1 : 0;
      auto err = p.job->error();
      if (sp->aborted) CHECK(err.has_value(), "%s: aborted but no error", p.path.c_str());
      if (cache_wait_timeout > 1 && !sp->aborted) CHECK(!err, "%s failed: %s", p.path.c_str(), err->c_str());
      if (err) {
        ++failed;
        CHECK(err->rfind(p.path + ": ", 0) == 0, "error does not name the job: %s", err->c_str());
        continue;
      }
      CHECK(sp->got == p.expected, "%s: streamed bytes differ", p.path.c_str());
      check_checksums(p, grid);
    }
  std::printf("stream phase %d: %zu jobs, %zu failed, %zu aborted (cache_wait_timeout=%g s)\n", phase, total, failed,
              aborted, cache_wait_timeout);
}

void check_crc() {
  const char* v = "123456789";
  CHECK(crc32c(v, 9) == 0xE3069283u, "crc32c(123456789)");
  CHECK(crc32c_software(v, 9) == 0xE3069283u, "crc32c_software(123456789)");
  std::mt19937_64 rng(5);
  std::vector<unsigned char> buf(100000);
  for (auto& c : buf) c = static_cast<unsigned char>(rng());
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 24575ul, 24576ul, 24577ul, 99990ul})
    for (size_t off : {0ul, 1ul, 5ul}) {
      CHECK(crc32c(buf.data() + off, n) == crc32c_software(buf.data() + off, n), "hw/sw differ n=%zu off=%zu", n, off);
      uint32_t a = crc32c(buf.data() + off, n / 3);
      CHECK(crc32c(buf.data() + off + n / 3, n - n / 3, a) == crc32c(buf.data() + off, n), "chaining n=%zu", n);
    }
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/dcpds_stress_XXXXXX";
  if (!mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 2;
  }
  const std::string dir = tmpl;
  check_crc();
  run_phase(dir, 1, 600.0, false);   // clean run: every job must succeed
  run_phase(dir, 2, 600.0, true);    // random faults
  run_phase(dir, 3, 0.0005, true);   // random faults and cache-wait timeouts
  run_stream_phase(dir, 4, 600.0, false);  // streaming: every job must succeed
  run_stream_phase(dir, 5, 600.0, true);   // consumers aborting midway
  run_stream_phase(dir, 6, 0.0005, true);  // and copies timing out on a full cache
  std::string cmd = "rm -rf '" + dir + "'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "warning: could not remove %s\n", dir.c_str());
  if (g_failures.load()) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures.load());
    return 1;
  }
  std::printf("stress: OK\n");
  return 0;
}
