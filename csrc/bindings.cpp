// pybind11 glue only: argument parsing, GIL handling and exception mapping for the engine.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "chunk_table.h"
#include "crc32c.h"
#include "engine.h"
#include "grid.h"
#include "tiling.h"
#include "hash64.h"
#include "io_util.h"
#include "write_job.h"

namespace py = pybind11;
using dcpds::Engine;
using dcpds::WriteJob;

namespace {

#if PY_VERSION_HEX >= 0x030D0000
inline bool interpreter_finalizing() { return Py_IsFinalizing() != 0; }
#else
inline bool interpreter_finalizing() { return _Py_IsFinalizing() != 0; }
#endif

// Releases the GIL around a blocking or long call and takes it back after: every binding uses
// this, not py::gil_scoped_release. A daemon thread (ours, DCP's) that is still in such a call
// when the interpreter finalizes is ended by PyEval_RestoreThread with pthread_exit; from
// pybind11's destructor (implicitly noexcept) that forced unwind calls std::terminate
// ("terminate called without an active exception"), aborting a process that had finished its
// work (the sliced waits below take the GIL back every 0.1 s, so a waiting thread hit it now and
// then). This guard does not take the GIL back once finalization has started: the thread parks
// until the process exits, as Python 3.14 parks such threads itself; and if finalization starts
// between the check and the call, its destructor lets the forced unwind through (noexcept(false)),
// the way pthread_exit leaves plain C frames.
class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  ~NoGil() noexcept(false) {
    if (interpreter_finalizing())
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(state_);
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_;
};

// A buffer of integers held for one call (any buffer-protocol object that names its item type:
// array('q'), array('i'), a typed ctypes view of a tensor's memory, a memoryview cast). An input
// may hold items of any type `dcpds::In` reads (its values are read as int64); an output must
// hold int64. An empty buffer of any type is an empty column.
class IntBuffer {
 public:
  // A writable buffer must hold `writable_type` items ('q' int64, or 'I' uint32).
  IntBuffer(py::handle obj, const char* name, bool writable, char writable_type = 'q') {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0)
      throw py::error_already_set();
    const char* format = view_.format != nullptr ? view_.format : "B";
    if (*format == '@' || *format == '=' || *format == '<') ++format;  // native = little-endian here
    type_ = item_type(*format, format[0] != '\0' ? format[1] : '\0', view_.itemsize);
    if (view_.len > 0 && (type_ == 0 || (writable && type_ != writable_type))) {
      const std::string what = std::string(name) + ": not a buffer of " +
                               (writable ? (writable_type == 'q' ? "int64" : "uint32") : "integer") +
                               " values (item type '" + (view_.format != nullptr ? view_.format : "B") + "', " +
                               std::to_string(view_.itemsize) + " bytes)";
      PyBuffer_Release(&view_);
      throw py::value_error(what);
    }
  }
  ~IntBuffer() { PyBuffer_Release(&view_); }
  IntBuffer(const IntBuffer&) = delete;
  IntBuffer& operator=(const IntBuffer&) = delete;
  size_t size() const { return view_.len > 0 ? static_cast<size_t>(view_.len / view_.itemsize) : 0; }
  // Refuses a non-empty column whose items are not one of `types` (In's letters).
  void require_type(const char* types, const char* name) const {
    if (size() > 0 && std::string(types).find(type_) == std::string::npos)
      throw py::value_error(std::string(name) + ": items of type '" + type_ + "', one of '" + types + "' expected");
  }
  dcpds::In in() const { return {view_.buf, size(), type_ != 0 ? type_ : 'q'}; }
  dcpds::Out out() const { return {static_cast<int64_t*>(view_.buf), size()}; }
  dcpds::Column<uint32_t> out_u32() const { return {static_cast<uint32_t*>(view_.buf), size()}; }

 private:
  // The In type of a one-letter struct format of `itemsize` bytes; 0 for any other.
  static char item_type(char code, char next, Py_ssize_t itemsize) {
    if (next != '\0') return 0;
    if (code == 'b' || code == 'i' || code == 'l' || code == 'q')
      return itemsize == 1 ? 'b' : itemsize == 4 ? 'i' : itemsize == 8 ? 'q' : 0;
    if ((code == 'I' || code == 'L') && itemsize == 4) return 'I';
    return 0;
  }

  Py_buffer view_{};
  char type_ = 0;
};

void require_size(const IntBuffer& b, size_t n, const char* name) {
  if (b.size() != n)
    throw py::value_error(std::string(name) + " holds " + std::to_string(b.size()) + " values, " + std::to_string(n) +
                          " expected");
}

// Large checksums release the GIL; small ones are cheaper than the release itself.
constexpr uint64_t kReleaseGilBytes = 1 << 20;

// Reads a non-negative int that fits in 64 bits; ValueError naming where it came from.
uint64_t as_u64(PyObject* o, const char* what, size_t index, const char* field) {
  py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(o));
  if (!idx) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + " " + std::to_string(index) + ": " + field + " must be an int");
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    overflow = 1;
  }
  if (overflow > 0) {  // too big for int64: allow the full uint64 range (pointers)
    unsigned long long u = PyLong_AsUnsignedLongLong(idx.ptr());
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error(std::string(what) + " " + std::to_string(index) + ": " + field + " is out of range");
    }
    return u;
  }
  if (overflow < 0 || v < 0)
    throw py::value_error(std::string(what) + " " + std::to_string(index) + ": " + field + " must be >= 0, got " +
                          py::str(idx).cast<std::string>());
  return static_cast<uint64_t>(v);
}

// Parses a list of N-int tuples with the raw C API: 20,000 items must take about a millisecond.
template <size_t N>
std::vector<std::array<uint64_t, N>> parse_tuples(py::handle seq_obj, const char* what,
                                                  const std::array<const char*, N>& names) {
  std::string fields = names[0];
  for (size_t k = 1; k < N; ++k) fields += std::string(", ") + names[k];
  std::string msg = std::string(what) + "s must be a list of (" + fields + ") tuples";
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(seq_obj.ptr(), msg.c_str()));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** elems = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<std::array<uint64_t, N>> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const size_t idx = static_cast<size_t>(i);
    py::object t = py::reinterpret_steal<py::object>(PySequence_Fast(elems[i], ""));
    if (!t || static_cast<size_t>(PySequence_Fast_GET_SIZE(t.ptr())) != N) {
      PyErr_Clear();
      throw py::value_error(std::string(what) + " " + std::to_string(idx) + " must be a tuple (" + fields + ")");
    }
    PyObject** f = PySequence_Fast_ITEMS(t.ptr());
    std::array<uint64_t, N> row;
    for (size_t k = 0; k < N; ++k) row[k] = as_u64(f[k], what, idx, names[k]);
    out.push_back(row);
  }
  return out;
}

// The (src_ptr, nbytes, file_offset) items of submit_write and submit_stream; src_ptr may also be
// a list of (src_ptr, nbytes) segments holding the item's bytes back to back.
std::vector<dcpds::WriteItem> parse_write_items(py::handle items) {
  const char* msg = "items must be a list of (src_ptr or [(src_ptr, nbytes), ...], nbytes, file_offset) tuples";
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(items.ptr(), msg));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** elems = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<dcpds::WriteItem> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const size_t idx = static_cast<size_t>(i);
    py::object t = py::reinterpret_steal<py::object>(PySequence_Fast(elems[i], ""));
    if (!t || PySequence_Fast_GET_SIZE(t.ptr()) != 3) {
      PyErr_Clear();
      throw py::value_error("item " + std::to_string(idx) + " must be a tuple (src_ptr, nbytes, file_offset)");
    }
    PyObject** f = PySequence_Fast_ITEMS(t.ptr());
    dcpds::WriteItem it{0, as_u64(f[1], "item", idx, "nbytes"), as_u64(f[2], "item", idx, "file_offset")};
    if (PyList_Check(f[0]) || PyTuple_Check(f[0])) {
      const std::string what = "item " + std::to_string(idx) + " segment";
      for (const auto& g : parse_tuples<2>(f[0], what.c_str(), {"src_ptr", "nbytes"}))
        it.segments.push_back(dcpds::SourceSegment{g[0], g[1]});
    } else {
      it.src = as_u64(f[0], "item", idx, "src_ptr");
    }
    out.push_back(std::move(it));
  }
  return out;
}

// read_into's (dst_ptr, file_offset, nbytes) ranges.
std::vector<dcpds::ReadRange> parse_read_ranges(py::handle ranges) {
  std::vector<dcpds::ReadRange> out;
  for (const auto& r : parse_tuples<3>(ranges, "range", {"dst_ptr", "file_offset", "nbytes"}))
    out.push_back(dcpds::ReadRange{r[0], r[1], r[2]});
  return out;
}

// read_into's (range_index, file_offset, nbytes, crc32c) checks.
std::vector<dcpds::ReadCheck> parse_read_checks(py::handle checks) {
  std::vector<dcpds::ReadCheck> out;
  if (checks.is_none()) return out;
  for (const auto& r : parse_tuples<4>(checks, "check", {"range_index", "file_offset", "nbytes", "crc32c"})) {
    if (r[3] > 0xFFFFFFFFull) throw py::value_error("check " + std::to_string(out.size()) + ": crc32c is not 32-bit");
    out.push_back(dcpds::ReadCheck{r[0], r[1], r[2], r[3]});
  }
  return out;
}

// Waits on a job in short slices with the GIL released, so Ctrl-C still works.
template <typename Wait>
bool wait_interruptible(Wait wait, std::optional<double> timeout) {
  using clock = std::chrono::steady_clock;
  if (timeout && *timeout < 0) throw py::value_error("timeout must be >= 0 or None");
  const auto start = clock::now();
  for (;;) {
    double slice = 0.1;
    if (timeout) {
      double left = *timeout - std::chrono::duration<double>(clock::now() - start).count();
      if (left < 0) left = 0;
      if (left < slice) slice = left;
    }
    bool ok;
    {
      NoGil nogil;
      ok = wait(slice);
    }
    if (ok) return true;
    if (timeout && std::chrono::duration<double>(clock::now() - start).count() >= *timeout) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

uint32_t seed_arg(long long seed) {
  if (seed < 0 || seed > 0xFFFFFFFFLL) throw py::value_error("seed must be in [0, 2**32), got " + std::to_string(seed));
  return static_cast<uint32_t>(seed);
}

uint32_t crc_of_buffer(py::handle data, long long seed) {
  const uint32_t s = seed_arg(seed);
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  uint32_t out;
  if (static_cast<uint64_t>(view.len) >= kReleaseGilBytes) {
    NoGil nogil;
    out = dcpds::crc32c(view.buf, static_cast<size_t>(view.len), s);
  } else {
    out = dcpds::crc32c(view.buf, static_cast<size_t>(view.len), s);
  }
  PyBuffer_Release(&view);
  return out;
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "dcp_datastates C++ engine: host cache, chunked copy/flush pipeline, CRC32C, parallel reads";
  m.attr("__version__") = "0.1.0";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dcpds::IoError& e) {
      // OSError(errno, msg) picks the subclass itself (FileNotFoundError for ENOENT, ...).
      py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err(), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const dcpds::ShortReadError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<WriteJob, std::shared_ptr<WriteJob>>(m, "WriteJob",
                                                  "One data file being written; returned by Engine.submit_write.")
      .def_property_readonly("path", &WriteJob::path)
      .def_property_readonly("nbytes", &WriteJob::nbytes, "total data bytes of the items")
      .def_property_readonly("nchunks", &WriteJob::nchunks, "number of chunks the file is written in")
      .def(
          "wait_staged",
          [](WriteJob& j, std::optional<double> timeout) {
            return wait_interruptible([&j](double s) { return j.wait_staged(s); }, timeout);
          },
          py::arg("timeout") = py::none(), "True once every byte is in the host cache (or the job failed)")
      .def(
          "wait_done",
          [](WriteJob& j, std::optional<double> timeout) {
            return wait_interruptible([&j](double s) { return j.wait_done(s); }, timeout);
          },
          py::arg("timeout") = py::none(), "True once the file is written and closed (or the job failed)")
      .def(
          "set_destination",
          [](WriteJob& j, const std::string& path) {
            auto* f = dynamic_cast<dcpds::FileJob*>(&j);
            if (f == nullptr) throw std::logic_error(j.path() + ": set_destination on a streaming job");
            NoGil nogil;
            f->set_destination(path);
          },
          py::arg("path"),
          "Names the file of a job submitted with named=False; its writes start now. Raises if it has one.")
      .def("is_staged", &WriteJob::is_staged)
      .def("is_done", &WriteJob::is_done)
      .def("all_enqueued", &WriteJob::all_enqueued,
           "True once every chunk's copy is issued (for a device job: queued on the copy stream)")
      .def_property_readonly("device", &WriteJob::device, "-1 for host sources, else the CUDA device")
      .def("error", &WriteJob::error, "None, or the message of the first error")
      .def("checksums", &WriteJob::checksums, "CRC32C per grid piece, per item in the order given")
      .def("piece_size", &WriteJob::piece_size, "the checksum grid size (the engine's chunk size)")
      .def_property_readonly("is_stream", &WriteJob::stream, "True for a job made by Engine.submit_stream")
      .def(
          "next_chunk",
          [](WriteJob& j, std::optional<double> timeout) -> py::object {
            if (!j.stream()) throw py::type_error(j.path() + ": next_chunk needs a job made by submit_stream");
            if (timeout && *timeout < 0) throw py::value_error("timeout must be >= 0 or None");
            using clock = std::chrono::steady_clock;
            const auto start = clock::now();
            dcpds::StreamChunk c{};
            for (;;) {  // slices with the GIL released, so Ctrl-C still works
              double slice = 0.1;
              if (timeout) {
                double left = *timeout - std::chrono::duration<double>(clock::now() - start).count();
                slice = std::max(0.0, std::min(slice, left));
              }
              WriteJob::Next r;
              {
                NoGil nogil;
                r = j.next_chunk(slice, &c);
              }
              if (r == WriteJob::Next::kChunk)
                return py::make_tuple(c.file_offset, reinterpret_cast<uintptr_t>(c.ptr), c.nbytes);
              if (r == WriteJob::Next::kEnd) return py::none();
              if (timeout && std::chrono::duration<double>(clock::now() - start).count() >= *timeout) {
                PyErr_SetString(PyExc_TimeoutError, (j.path() + ": no chunk ready within the timeout").c_str());
                throw py::error_already_set();
              }
              if (PyErr_CheckSignals() != 0) throw py::error_already_set();
            }
          },
          py::arg("timeout") = py::none(),
          "Streaming jobs: the next chunk in file order as (file_offset, ptr, nbytes) once it is in the host\n"
          "cache and checksummed; None when every chunk was handed out or the job failed (see error()).\n"
          "The memory at ptr stays valid until release(file_offset). TimeoutError after `timeout` seconds.")
      .def("release", &WriteJob::release, py::arg("file_offset"),
           "Streaming jobs: give back the cache slot of the chunk at file_offset (from next_chunk).")
      .def("fail", &WriteJob::abort, py::arg("message"),
           "Fail the job with `message` at once (first error wins); returns immediately. Streaming jobs\n"
           "give back every slot they hold (chunks handed out included: their memory must not be used\n"
           "after this). File jobs skip their remaining copies and writes, give their slots back and are\n"
           "done (waiters wake) within milliseconds; the file is left incomplete.")
      .def_property_readonly("bytes_done", &WriteJob::bytes_done,
                             "data bytes written so far (streaming jobs: released by the consumer)")
      .def_property_readonly("written_prefix", &WriteJob::written_prefix,
                             "File jobs: bytes [0, written_prefix) of the file hold their final contents (the header\n"
                             "and every chunk up to the first one not yet written); the file size once done")
      .def(
          "wait_written",
          [](WriteJob& j, uint64_t at_least, std::optional<double> timeout) {
            uint64_t prefix = 0;
            wait_interruptible(
                [&](double s) {
                  prefix = j.wait_written(at_least, s);
                  return prefix >= at_least || j.failed() || j.is_done();
                },
                timeout);
            return prefix;
          },
          py::arg("at_least"), py::arg("timeout") = py::none(),
          "File jobs: wait until written_prefix >= at_least, the job fails or is done, or `timeout`\n"
          "seconds pass; returns written_prefix")
      .def("chunks_held", &WriteJob::chunks_held, "Streaming jobs: chunks handed out and not yet released")
      .def("__repr__", [](const WriteJob& j) {
        return "<WriteJob " + j.path() + " nbytes=" + std::to_string(j.nbytes()) +
               (j.is_done() ? (j.failed() ? " failed>" : " done>") : (j.is_staged() ? " staged>" : " pending>"));
      });

  py::class_<Engine>(m, "Engine", "Process-wide write/read engine with one preallocated host cache.")
      .def(py::init([](int64_t cache_bytes, int64_t chunk_bytes, int copy_threads, int flush_threads,
                       int read_threads, int64_t alignment, double cache_wait_timeout_s, bool pin,
                       bool prefault) {
             dcpds::EngineConfig cfg;
             cfg.cache_bytes = cache_bytes;
             cfg.chunk_bytes = chunk_bytes;
             cfg.copy_threads = copy_threads;
             cfg.flush_threads = flush_threads;
             cfg.read_threads = read_threads;
             cfg.alignment = alignment;
             cfg.cache_wait_timeout_s = cache_wait_timeout_s;
             cfg.pin = pin;
             cfg.prefault = prefault;
             NoGil nogil;  // a large allocation (and pinning it) can take a while
             return std::make_unique<Engine>(cfg);
           }),
           py::arg("cache_bytes"), py::kw_only(), py::arg("chunk_bytes"), py::arg("copy_threads"),
           py::arg("flush_threads"), py::arg("read_threads"), py::arg("alignment"),
           py::arg("cache_wait_timeout_s"), py::arg("pin"), py::arg("prefault"),
           "Every argument is required: the defaults are DataStatesConfig's (runtime.py passes them).\n"
           "Allocates the host cache and starts the threads. Loads the CUDA runtime named by\n"
           "$DCP_DATASTATES_CUDART (\"none\": CPU mode), else the libcudart PyTorch loaded, else\n"
           "libcudart.so(.13/.12); with it and pin=True the cache is page-locked once. With\n"
           "prefault=True a background thread then faults the whole cache in (stats:\n"
           "cache_prefaulted_bytes); construction never waits for it.")
      .def(
          "submit_write",
          [](Engine& e, const std::string& path, py::bytes header, int64_t file_size, py::handle items, bool sync,
             int device, uint64_t stream, bool named, bool direct, bool direct_io) {
            if (e.is_shut_down()) throw std::runtime_error("engine is shut down");
            if (file_size < 0) throw py::value_error("file_size must be >= 0, got " + std::to_string(file_size));
            std::vector<dcpds::WriteItem> parsed = parse_write_items(items);
            std::string head = header;
            // No GIL release: submitting only enqueues (microseconds), and handing the GIL to
            // another thread here would cost the training thread up to a switch interval.
            return e.submit_write(path, std::move(head), static_cast<uint64_t>(file_size), parsed, sync, device, stream,
                                  named, direct, direct_io);
          },
          py::arg("path"), py::arg("header"), py::arg("file_size"), py::arg("items"), py::arg("sync") = true,
          py::arg("device") = -1, py::arg("stream") = 0, py::arg("named") = true, py::arg("direct") = false,
          py::arg("direct_io") = false,
          py::keep_alive<0, 1>(),
          "Queue one file: header at offset 0, items (src_ptr, nbytes, file_offset). Returns a WriteJob at once;\n"
          "errors are reported by WriteJob.error(). The source memory must stay valid until the job is staged.\n"
          "device >= 0: the src pointers are on that CUDA device and stream is the caller's current CUDA stream\n"
          "there (int handle, 0 = legacy default): the copies run after the work queued on it so far.\n"
          "named=False: path only labels the job; the copies start now and the writes wait until\n"
          "job.set_destination(path) names the file (or the job fails). The job keeps the engine alive.\n"
          "direct=True (host sources only): no copy into the host cache; the flush workers write the file\n"
          "from the sources, and the job is staged once it is written (for memory-backed folders).")
      .def(
          "submit_stream",
          [](Engine& e, const std::string& label, py::bytes header, int64_t file_size, py::handle items, int device,
             uint64_t stream) {
            if (e.is_shut_down()) throw std::runtime_error("engine is shut down");
            if (file_size < 0) throw py::value_error("file_size must be >= 0, got " + std::to_string(file_size));
            std::vector<dcpds::WriteItem> parsed = parse_write_items(items);
            std::string head = header;
            return e.submit_stream(label, std::move(head), static_cast<uint64_t>(file_size), parsed, device, stream);
          },
          py::arg("label"), py::arg("header"), py::arg("file_size"), py::arg("items"), py::arg("device") = -1,
          py::arg("stream") = 0, py::keep_alive<0, 1>(),
          "Like submit_write, but nothing is written: the consumer takes the chunks in file order with\n"
          "job.next_chunk() and gives each back with job.release(file_offset) (or job.fail(message)).\n"
          "The consumer writes the header (bytes [0, len(header))) itself and zero-fills any gap between\n"
          "chunks and up to file_size. label (a URL) names the job in errors. The job keeps the engine alive.")
      .def(
          "snapshot",
          [](Engine& e, int device, uint64_t stream, uint64_t dst, py::handle items, const std::string& what) {
            if (e.is_shut_down()) throw std::runtime_error("engine is shut down");
            std::vector<dcpds::WriteItem> parsed = parse_write_items(items);
            for (size_t i = 0; i < parsed.size(); ++i)
              if (!parsed[i].segments.empty()) throw py::value_error("snapshot item " + std::to_string(i) + ": one src_ptr, not segments");
            e.snapshot(device, stream, dst, parsed, what);  // small copies: the GIL stays held
          },
          py::arg("device"), py::arg("stream"), py::arg("dst"), py::arg("items"), py::arg("what"),
          "Copy items (src_ptr, nbytes, dst_offset) to dst + dst_offset now, in stream order: host memory\n"
          "(device -1) with memcpy; CUDA memory device-to-device on `stream` (the caller's current stream\n"
          "on `device`), so kernels queued after this call cannot change what is copied.")
      .def("device_wait", &Engine::device_wait, py::arg("job"), py::arg("stream"),
           "For a device job whose copies are all queued: make `stream` wait on the GPU for them and return\n"
           "True without blocking (True too when the job is staged). False: wait on the host instead.")
      .def_property_readonly("cuda_runtime", &Engine::cuda_runtime_path, "path of the CUDA runtime in use; '' in CPU mode")
      .def_property_readonly("cuda_devices", &Engine::cuda_device_count, "CUDA devices the runtime sees; 0 in CPU mode")
      .def_property_readonly("cuda_status", &Engine::cuda_status,
                             "CPU mode: why there is no CUDA; CUDA mode: why the cache is not pinned ('' if it is)")
      .def(
          "read_into",
          [](Engine& e, const std::string& path, py::handle ranges, py::handle checks, int threads) -> py::object {
            std::vector<dcpds::ReadRange> parsed = parse_read_ranges(ranges);
            std::vector<dcpds::ReadCheck> wanted = parse_read_checks(checks);
            std::optional<dcpds::ReadMismatch> bad;
            {
              NoGil nogil;
              bad = e.read_into(path, parsed, wanted, threads);
            }
            if (!bad) return py::none();
            return py::make_tuple(bad->range, bad->file_offset, bad->nbytes, bad->expected, bad->found);
          },
          py::arg("path"), py::arg("ranges"), py::arg("checks") = py::none(), py::arg("threads") = 0,
          "Parallel pread of (dst_ptr, file_offset, nbytes) ranges by up to `threads` workers (0: all\n"
          "read threads), each reading a contiguous part of the file with its own descriptor.\n"
          "checks: (range_index, file_offset, nbytes, crc32c) pieces of those ranges, verified right after\n"
          "they are read. Returns None, or the first mismatch as (range_index, file_offset, nbytes,\n"
          "expected, found); reading stops at it.")
      .def(
          "crc32c",
          [](Engine&, uint64_t ptr, int64_t nbytes, long long seed) {
            if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
            if (nbytes > 0 && ptr == 0) throw py::value_error("ptr is null");
            const uint32_t s = seed_arg(seed);
            const void* p = reinterpret_cast<const void*>(static_cast<uintptr_t>(ptr));
            if (static_cast<uint64_t>(nbytes) >= kReleaseGilBytes) {
              NoGil nogil;
              return dcpds::crc32c(p, static_cast<size_t>(nbytes), s);
            }
            return dcpds::crc32c(p, static_cast<size_t>(nbytes), s);
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0)
      .def(
          "crc32c_ranges",
          [](Engine&, uint64_t ptr, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
            for (const auto& [off, n] : ranges)
              if (off < 0 || n < 0) throw py::value_error("offsets and lengths must be >= 0");
            if (ptr == 0 && !ranges.empty()) throw py::value_error("ptr is null");
            std::vector<uint32_t> out(ranges.size());
            {
              NoGil nogil;  // many small pieces: one call, no GIL
              const char* base = reinterpret_cast<const char*>(static_cast<uintptr_t>(ptr));
              for (size_t i = 0; i < ranges.size(); ++i)
                out[i] = dcpds::crc32c(base + ranges[i].first, static_cast<size_t>(ranges[i].second), 0);
            }
            return out;
          },
          py::arg("ptr"), py::arg("ranges"),
          "CRC32C of each (offset, nbytes) range of the memory at ptr, computed without the GIL.")
      .def("stats",
           [](const Engine& e) {
             const dcpds::EngineStats s = e.stats();
             py::dict d;
             d["cache_bytes"] = s.cache_bytes;
             d["chunk_bytes"] = s.chunk_bytes;
             d["alignment"] = s.alignment;
             d["cache_address"] = s.cache_address;
             d["cache_allocations"] = s.cache_allocations;
             d["slots_total"] = s.slots_total;
             d["slots_free"] = s.slots_free;
             d["peak_slots_used"] = s.peak_slots_used;
             d["cache_prefaulted_bytes"] = s.cache_prefaulted_bytes;
             d["bytes_staged"] = s.bytes_staged;
             d["bytes_flushed"] = s.bytes_flushed;
             d["bytes_read"] = s.bytes_read;
             d["chunks_staged"] = s.chunks_staged;
             d["chunks_flushed"] = s.chunks_flushed;
             d["jobs_submitted"] = s.jobs_submitted;
             d["jobs_done"] = s.jobs_done;
             d["jobs_failed"] = s.jobs_failed;
             d["backpressure_waits"] = s.backpressure_waits;
             d["copy_threads"] = s.copy_threads;
             d["flush_threads"] = s.flush_threads;
             d["read_threads"] = s.read_threads;
             d["hw_crc32c"] = s.hw_crc32c;
             d["cuda"] = s.cuda;
             d["pinned"] = s.pinned;
             d["d2h_bytes"] = s.d2h_bytes;
             d["direct_bytes"] = s.direct_bytes;
             d["direct_io_bytes"] = s.direct_io_bytes;
             d["direct_io_refused"] = s.direct_io_refused;
             d["device_waits"] = s.device_waits;
             d["host_waits"] = s.host_waits;
             d["flush_ns"] = s.flush_ns;
             d["checksum_ns"] = s.checksum_ns;
             return d;
           })
      .def("set_checksums", &Engine::set_checksums, py::arg("on"),
           "Benchmark hook: False skips the per-piece CRC32C (checksums then read 0), to measure its cost.")
      .def("set_fault", &Engine::set_fault, py::arg("kind"), py::arg("after_bytes") = 0,
           py::arg("path_substring") = "", "Test hook: none, eio, enospc, short_write, fsync_eio, stall or direct_einval.")
      .def("shutdown", &Engine::shutdown, py::call_guard<NoGil>(),
           "Idempotent: finish every submitted job, then stop the threads.")
      .def_property_readonly("is_shut_down", &Engine::is_shut_down);

  m.def(
      "start_writeback",
      [](int fd, int64_t offset, int64_t nbytes) {
        if (fd < 0 || offset < 0 || nbytes < 0) throw py::value_error("fd, offset and nbytes must be >= 0");
        dcpds::start_writeback(fd, static_cast<uint64_t>(offset), static_cast<uint64_t>(nbytes));
      },
      py::arg("fd"), py::arg("offset"), py::arg("nbytes"),
      "Start writing a just-written file range to the disk without waiting (a hint, as the engine\n"
      "gives its own files: the final fsync then finds little left). Errors are ignored.");
  m.def(
      "memory_backed",
      [](const std::string& path) { return dcpds::memory_backed(path); }, py::arg("path"),
      py::call_guard<NoGil>(),
      "True when path (or, while it does not exist, its nearest existing parent folder) is on a\n"
      "memory-backed file system (tmpfs, ramfs): there a file's bytes are written at memory speed.");
  m.def("crc32c", &crc_of_buffer, py::arg("data"), py::arg("seed") = 0,
        "CRC32C of a contiguous buffer; pass a previous result as seed to continue it.");
  m.def("hash64", [](py::handle data) -> uint64_t {
    Py_buffer view;
    if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
    uint64_t out;
    if (static_cast<uint64_t>(view.len) >= kReleaseGilBytes) {
      NoGil nogil;
      out = dcpds::hash64(view.buf, static_cast<size_t>(view.len));
    } else {
      out = dcpds::hash64(view.buf, static_cast<size_t>(view.len));
    }
    PyBuffer_Release(&view);
    return out;
  }, py::arg("data"),
        "XXH64 with seed 0 of a contiguous buffer (bytes or any buffer-protocol object), as an int in\n"
        "[0, 2**64): the content hash that tells whether a tensor's bytes are unchanged since an earlier\n"
        "checkpoint (incremental saves). Equals hash64_segments([[(ptr, len)]])[0] over the same bytes.");
  m.def("hash64_segments", [](py::handle items) {
    py::object seq = py::reinterpret_steal<py::object>(
        PySequence_Fast(items.ptr(), "items must be a list of [(ptr, nbytes), ...] segment lists"));
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** elems = PySequence_Fast_ITEMS(seq.ptr());
    std::vector<std::vector<std::array<uint64_t, 2>>> segments;
    segments.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {  // all checks first, with the GIL
      const std::string what = "item " + std::to_string(i) + " segment";
      segments.push_back(parse_tuples<2>(elems[i], what.c_str(), {"ptr", "nbytes"}));
      for (size_t j = 0; j < segments.back().size(); ++j) {
        const auto& g = segments.back()[j];
        if (g[0] == 0 && g[1] > 0)
          throw py::value_error(what + " " + std::to_string(j) + ": ptr is null with nbytes " + std::to_string(g[1]));
      }
    }
    std::vector<uint64_t> out(segments.size());
    {
      NoGil nogil;
      for (size_t i = 0; i < segments.size(); ++i) {
        dcpds::Hash64 h;
        for (const auto& g : segments[i])
          h.update(reinterpret_cast<const void*>(static_cast<uintptr_t>(g[0])), static_cast<size_t>(g[1]));
        out[i] = h.digest();
      }
    }
    return out;
  }, py::arg("items"),
        "XXH64 with seed 0 of each item, an item being a list of (ptr, nbytes) memory segments that\n"
        "hash as their concatenation (an empty list hashes as the empty input), as ints in [0, 2**64):\n"
        "the content hashes that tell whether tensors' bytes are unchanged since an earlier checkpoint\n"
        "(incremental saves). Hashes with the GIL released; the memory must stay valid and unchanged\n"
        "until it returns. ValueError naming the item and segment for a negative nbytes or a null ptr\n"
        "with nbytes > 0.");
  m.def("_crc32c_software", [](py::bytes data, long long seed) {
    std::string_view v = data;
    return dcpds::crc32c_software(v.data(), v.size(), seed_arg(seed));
  }, py::arg("data"), py::arg("seed") = 0, "Portable implementation, for tests.");
  m.def("_crc32c_using", [](const std::string& name, py::bytes data, long long seed) {
    std::string_view v = data;
    return dcpds::crc32c_using(name, v.data(), v.size(), seed_arg(seed));
  }, py::arg("name"), py::arg("data"), py::arg("seed") = 0, "One named implementation, for tests.");
  m.def("crc32c_implementations", &dcpds::crc32c_implementations,
        "The CRC32C implementations this CPU runs, the one in use first.");
  m.def("hw_crc32c", &dcpds::crc32c_hardware_available, "True when CRC32C uses a hardware path.");

  // The checksum grid (grid.h), for the Python side of the format (checkpoint_format.piece_ranges).
  auto check_grid = [](int64_t offset, int64_t length, int64_t data_start, int64_t piece_size) {
    if (piece_size <= 0) throw py::value_error("piece_size must be positive, got " + std::to_string(piece_size));
    if (data_start < 0 || offset < data_start || length < 0)
      throw py::value_error("item [" + std::to_string(offset) + ", +" + std::to_string(length) +
                            ") does not lie in the data region starting at " + std::to_string(data_start));
  };
  m.def("piece_count", [check_grid](int64_t offset, int64_t length, int64_t data_start, int64_t piece_size) {
    check_grid(offset, length, data_start, piece_size);
    return dcpds::grid::piece_count(offset, length, data_start, piece_size);
  }, py::arg("offset"), py::arg("length"), py::arg("data_start"), py::arg("piece_size"),
        "Checksum pieces of the item [offset, offset + length) on the grid of step piece_size from data_start.");
  m.def("piece_ranges", [check_grid](int64_t offset, int64_t length, int64_t data_start, int64_t piece_size) {
    check_grid(offset, length, data_start, piece_size);
    py::list out;
    dcpds::grid::for_each_piece(offset, length, data_start, piece_size, [&](uint64_t pos, uint64_t len) {
      out.append(py::make_tuple(pos, len));
    });
    return out;
  }, py::arg("offset"), py::arg("length"), py::arg("data_start"), py::arg("piece_size"),
        "(file offset, length) of each checksum piece of the item, in order (the grid the engine cuts on).");

  // The packed chunk table's checks (chunk_table.h), for dcp_datastates/format/packed.py.
  m.def("check_chunk_table", [](py::handle counts, py::handle ndims, py::handle itemsizes, py::handle dims,
                                py::handle offsets, py::handle sizes, py::handle file, py::handle offset,
                                py::handle length, py::handle crc_count, py::handle file_size, py::handle data_start,
                                py::handle piece_size, py::handle crc_starts, py::handle sorted0,
                                py::handle widest0) -> py::object {
    const IntBuffer b_counts(counts, "counts", false), b_ndims(ndims, "ndims", false),
        b_items(itemsizes, "itemsizes", false), b_dims(dims, "dims", false), b_offsets(offsets, "offsets", false),
        b_sizes(sizes, "sizes", false), b_file(file, "file", false), b_offset(offset, "offset", false),
        b_length(length, "length", false), b_crc(crc_count, "crc_count", false),
        b_fsize(file_size, "file_size", false), b_fstart(data_start, "data_start", false),
        b_fstep(piece_size, "piece_size", false), o_crc(crc_starts, "crc_starts", true),
        o_sorted(sorted0, "sorted0", true), o_widest(widest0, "widest0", true);
    const size_t T = b_counts.size();
    require_size(b_ndims, T, "ndims");
    require_size(b_items, T, "itemsizes");
    require_size(o_sorted, T, "sorted0");
    require_size(o_widest, T, "widest0");
    size_t values = 0, chunks = 0, ndim_total = 0;
    for (size_t k = 0; k < T; ++k) {
      const int64_t n = b_counts.in()[k], d = b_ndims.in()[k];
      if (n < 0 || d < 0 || d > 64) throw py::value_error("tensor " + std::to_string(k) + ": bad chunk count or ndim");
      values += static_cast<size_t>(n) * static_cast<size_t>(d);
      chunks += static_cast<size_t>(n);
      ndim_total += static_cast<size_t>(d);
    }
    require_size(b_dims, ndim_total, "dims");
    require_size(b_offsets, values, "offsets");
    require_size(b_sizes, values, "sizes");
    for (const IntBuffer* b : {&b_file, &b_offset, &b_length, &b_crc}) require_size(*b, chunks, "a chunk column");
    require_size(o_crc, chunks + 1, "crc_starts");
    require_size(b_fstart, b_fsize.size(), "data_start");
    require_size(b_fstep, b_fsize.size(), "piece_size");
    dcpds::ChunkTable table{b_counts.in(), b_ndims.in(), b_items.in(), b_dims.in(), b_offsets.in(), b_sizes.in(),
                            b_file.in(), b_offset.in(), b_length.in(), b_crc.in(), b_fsize.in(), b_fstart.in(),
                            b_fstep.in()};
    if (!dcpds::typed_alike(table))
      throw py::value_error("offsets and sizes, and file, offset, length and crc_count, must each share one item "
                            "type, int32 or int64");
    dcpds::TableError error;
    bool ok;
    {
      NoGil nogil;
      ok = dcpds::check_chunk_table(table, o_crc.out(), o_sorted.out(), o_widest.out(), &error);
    }
    if (ok) return py::none();
    return py::make_tuple(error.kind, error.tensor, error.chunk, error.dim, error.a, error.b);
  }, py::arg("counts"), py::arg("ndims"), py::arg("itemsizes"), py::arg("dims"), py::arg("offsets"), py::arg("sizes"),
        py::arg("file"), py::arg("offset"), py::arg("length"), py::arg("crc_count"), py::arg("file_size"),
        py::arg("data_start"), py::arg("piece_size"), py::arg("crc_starts"), py::arg("sorted0"), py::arg("widest0"),
        "Check a packed chunk table (integer buffers, the outputs int64). None, filling the outputs, or\n"
        "the first failure as "
        "(kind, tensor, chunk, dim, a, b) (chunk_table.h names the kinds).");
  m.def("place_chunks", [](py::handle tensor_keys, py::handle counts, py::handle ndims, py::handle table_offsets,
                           py::handle key, py::handle position, py::handle ndim, py::handle offsets, int64_t first,
                           py::handle src, py::handle status) {
    const IntBuffer b_keys(tensor_keys, "tensor_keys", false), b_counts(counts, "counts", false),
        b_ndims(ndims, "ndims", false), b_toff(table_offsets, "table_offsets", false), b_key(key, "key", false),
        b_pos(position, "position", false), b_ndim(ndim, "ndim", false), b_off(offsets, "offsets", false),
        o_src(src, "src", true), o_status(status, "status", true);
    const size_t T = b_keys.size(), N = b_key.size();
    require_size(b_counts, T, "counts");
    require_size(b_ndims, T, "ndims");
    size_t values = 0, chunks = 0, given = 0;
    for (size_t k = 0; k < T; ++k) {
      const int64_t n = b_counts.in()[k], d = b_ndims.in()[k];
      if (n < 0 || d < 0 || d > 64) throw py::value_error("tensor " + std::to_string(k) + ": bad chunk count or ndim");
      values += static_cast<size_t>(n * d);
      chunks += static_cast<size_t>(n);
    }
    require_size(b_toff, values, "table_offsets");
    require_size(o_src, chunks, "src");
    require_size(b_pos, N, "position");
    require_size(b_ndim, N, "ndim");
    require_size(o_status, N, "status");
    for (size_t i = 0; i < N; ++i) {
      const int64_t d = b_ndim.in()[i];
      if (d < 0 || d > 64) throw py::value_error("result " + std::to_string(i) + ": bad ndim " + std::to_string(d));
      given += static_cast<size_t>(d);
    }
    require_size(b_off, given, "offsets");
    if (first < 0) throw py::value_error("first must not be negative, got " + std::to_string(first));
    b_toff.require_type("iq", "table_offsets");
    b_off.require_type("iq", "offsets");
    NoGil nogil;
    dcpds::place_chunks(b_keys.in(), b_counts.in(), b_ndims.in(), b_toff.in(), b_key.in(), b_pos.in(), b_ndim.in(),
                        b_off.in(), first, o_src.out(), o_status.out());
  }, py::arg("tensor_keys"), py::arg("counts"), py::arg("ndims"), py::arg("table_offsets"), py::arg("key"),
        py::arg("position"), py::arg("ndim"), py::arg("offsets"), py::arg("first"), py::arg("src"), py::arg("status"),
        "Place chunk results in the table by name key and position hint, numbering them from `first`\n"
        "(chunk_table.h); integer buffers (the outputs int64), src's other rows left as they are.");
  m.def("gather_pieces", [](py::handle src, py::handle crc_count, py::handle crcs, py::handle out) {
    const IntBuffer b_src(src, "src", false), b_cnt(crc_count, "crc_count", false), b_crcs(crcs, "crcs", false),
        o_out(out, "out", true, 'I');
    b_crcs.require_type("I", "crcs");
    const size_t N = b_cnt.size();
    int64_t total_crcs = 0;
    for (size_t i = 0; i < N; ++i) {
      if (b_cnt.in()[i] < 0) throw py::value_error("result " + std::to_string(i) + ": negative checksum count");
      total_crcs += b_cnt.in()[i];
    }
    require_size(b_crcs, static_cast<size_t>(total_crcs), "crcs");
    // Where each result's checksums start: 32-bit while they fit (one per result, millions of them).
    std::vector<uint32_t> first32;
    std::vector<int64_t> first64;
    dcpds::In first;
    if (total_crcs <= static_cast<int64_t>(UINT32_MAX)) {
      first32.assign(N + 1, 0);
      for (size_t i = 0; i < N; ++i) first32[i + 1] = first32[i] + static_cast<uint32_t>(b_cnt.in()[i]);
      first = {first32.data(), first32.size(), 'I'};
    } else {
      first64.assign(N + 1, 0);
      for (size_t i = 0; i < N; ++i) first64[i + 1] = first64[i] + b_cnt.in()[i];
      first = {first64.data(), first64.size(), 'q'};
    }
    size_t total = 0;
    for (size_t r = 0; r < b_src.size(); ++r) {
      const int64_t i = b_src.in()[r];
      if (i < 0 || static_cast<size_t>(i) >= N)
        throw py::value_error("row " + std::to_string(r) + ": no result " + std::to_string(i));
      total += static_cast<size_t>(b_cnt.in()[static_cast<size_t>(i)]);
    }
    require_size(o_out, total, "out");
    NoGil nogil;
    dcpds::gather_pieces(b_src.in(), first, b_crcs.in(), o_out.out_u32());
  }, py::arg("src"), py::arg("crc_count"), py::arg("crcs"), py::arg("out"),
        "The placed rows' checksums in row order (chunk_table.h); integer buffers, `crcs` and `out`\n"
        "uint32, `out` sized to them.");
  m.def("find_bad_tilings", [](py::handle counts, py::handle ndims, py::handle dims, py::handle offsets,
                               py::handle sizes, bool check_covered) {
    const IntBuffer b_counts(counts, "counts", false), b_ndims(ndims, "ndims", false), b_dims(dims, "dims", false),
        b_off(offsets, "offsets", false), b_sizes(sizes, "sizes", false);
    require_size(b_ndims, b_counts.size(), "ndims");
    size_t values = 0, ndim_total = 0;
    for (size_t k = 0; k < b_counts.size(); ++k) {
      if (b_counts.in()[k] < 0 || b_ndims.in()[k] < 0) throw py::value_error("a negative count or ndim");
      values += static_cast<size_t>(b_counts.in()[k] * b_ndims.in()[k]);
      ndim_total += static_cast<size_t>(b_ndims.in()[k]);
    }
    require_size(b_dims, ndim_total, "dims");
    require_size(b_off, values, "offsets");
    require_size(b_sizes, values, "sizes");
    std::vector<int64_t> bad;
    {
      NoGil nogil;
      bad = dcpds::find_bad_tilings(b_counts.in(), b_ndims.in(), b_dims.in(), b_off.in(), b_sizes.in(), check_covered);
    }
    return bad;
  }, py::arg("counts"), py::arg("ndims"), py::arg("dims"), py::arg("offsets"), py::arg("sizes"),
        py::arg("check_covered"),
        "The indices of the tensors whose chunks do not tile them (tiling.h); integer buffers, the\n"
        "chunks' offsets and sizes chunk by chunk.");
  m.def("find_shared_bytes", [](py::handle fid, py::handle start, py::handle length, int64_t files,
                                int64_t ordered) -> py::object {
    const IntBuffer b_fid(fid, "fid", false), b_start(start, "start", false), b_length(length, "length", false);
    require_size(b_start, b_fid.size(), "start");
    require_size(b_length, b_fid.size(), "length");
    for (size_t i = 0; i < b_fid.size(); ++i)
      if (b_fid.in()[i] < 0 || b_fid.in()[i] >= files)
        throw py::value_error("item " + std::to_string(i) + ": file index " + std::to_string(b_fid.in()[i]) +
                              " out of range");
    int64_t first = -1, second = -1;
    bool shared;
    {
      NoGil nogil;
      shared = dcpds::find_shared_bytes(b_fid.in(), b_start.in(), b_length.in(), files,
                                        ordered < 0 ? b_fid.size() : static_cast<size_t>(ordered), &first, &second);
    }
    if (!shared) return py::none();
    return py::make_tuple(first, second);
  }, py::arg("fid"), py::arg("start"), py::arg("length"), py::arg("files"), py::arg("ordered") = -1,
        "None when no two items [start, start + length) of one file share a byte, else the indices of\n"
        "the first pair that does, in (file, start) order. The first `ordered` items (-1: all) are\n"
        "expected in increasing order within each file.");
}
