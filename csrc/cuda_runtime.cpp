#include "cuda_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace dcpds {
namespace {

// Paths of libcudart*.so* files mapped into this process, in the order they appear.
std::vector<std::string> mapped_runtimes() {
  std::vector<std::string> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    const size_t base = path.rfind('/');
    if (path.compare(base + 1, 12, "libcudart.so") != 0) continue;
    if (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0) continue;
    bool seen = false;
    for (const auto& p : out) seen = seen || p == path;
    if (!seen) out.push_back(path);
  }
  return out;
}

template <typename F>
bool bind(void* handle, const char* name, F*& slot, std::string* missing) {
  slot = reinterpret_cast<F*>(dlsym(handle, name));
  if (!slot && missing->empty()) *missing = name;
  return slot != nullptr;
}

// dlopen + dlsym of every entry point; nullptr with *why set on failure. Never dlclose'd.
std::unique_ptr<CudaApi> open_runtime(const std::string& name, std::string* why) {
  dlerror();
  void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = name + ": " + (e ? e : "dlopen failed");
    return nullptr;
  }
  auto api = std::make_unique<CudaApi>();
  std::string missing;
  bind(h, "cudaGetDeviceCount", api->GetDeviceCount, &missing);
  bind(h, "cudaSetDevice", api->SetDevice, &missing);
  bind(h, "cudaGetDevice", api->GetDevice, &missing);
  bind(h, "cudaHostRegister", api->HostRegister, &missing);
  bind(h, "cudaHostUnregister", api->HostUnregister, &missing);
  bind(h, "cudaStreamCreateWithFlags", api->StreamCreateWithFlags, &missing);
  bind(h, "cudaStreamDestroy", api->StreamDestroy, &missing);
  bind(h, "cudaEventCreateWithFlags", api->EventCreateWithFlags, &missing);
  bind(h, "cudaEventDestroy", api->EventDestroy, &missing);
  bind(h, "cudaEventRecord", api->EventRecord, &missing);
  bind(h, "cudaEventQuery", api->EventQuery, &missing);
  bind(h, "cudaEventSynchronize", api->EventSynchronize, &missing);
  bind(h, "cudaStreamWaitEvent", api->StreamWaitEvent, &missing);
  bind(h, "cudaMemcpyAsync", api->MemcpyAsync, &missing);
  bind(h, "cudaStreamSynchronize", api->StreamSynchronize, &missing);
  bind(h, "cudaGetErrorString", api->GetErrorString, &missing);
  if (!missing.empty()) {
    *why = name + ": has no " + missing;
    return nullptr;  // the handle stays open: harmless, and closing could unload PyTorch's copy
  }
  Dl_info info;
  api->path = (dladdr(reinterpret_cast<void*>(api->GetDeviceCount), &info) && info.dli_fname) ? info.dli_fname : name;
  return api;
}

std::mutex g_mu;
// One entry per name ever loaded; intentionally leaked (see CudaApi).
std::map<std::string, CudaApi*>* g_loaded = new std::map<std::string, CudaApi*>();

const CudaApi* open_cached(const std::string& name, std::string* why) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_loaded->find(name);
  if (it != g_loaded->end()) return it->second;
  std::unique_ptr<CudaApi> api = open_runtime(name, why);
  if (!api) return nullptr;
  CudaApi* raw = api.release();
  (*g_loaded)[name] = raw;
  return raw;
}

}  // namespace

std::string CudaApi::error_text(cudaError err) const {
  const char* s = GetErrorString ? GetErrorString(err) : nullptr;
  return std::string(s ? s : "unknown CUDA error") + " (CUDA error " + std::to_string(err) + ")";
}

const CudaApi* load_cuda_runtime(std::string* why) {
  const char* env = std::getenv(kCudartEnv);
  if (env && *env) {
    const std::string forced = env;
    if (forced == "none" || forced == "0") {
      *why = std::string(kCudartEnv) + "=" + forced;
      return nullptr;
    }
    std::string err;
    const CudaApi* api = open_cached(forced, &err);
    if (!api) *why = std::string(kCudartEnv) + ": " + err;
    return api;
  }
  std::vector<std::string> candidates = mapped_runtimes();
  for (const char* soname : {"libcudart.so", "libcudart.so.13", "libcudart.so.12"}) candidates.push_back(soname);
  std::string errors;
  for (const auto& name : candidates) {
    std::string err;
    if (const CudaApi* api = open_cached(name, &err)) return api;
    errors += (errors.empty() ? "" : "; ") + err;
  }
  *why = "no CUDA runtime found (" + errors + ")";
  return nullptr;
}

DeviceGuard::DeviceGuard(const CudaApi& api, int device) : api_(api) {
  int current = -1;
  if (api_.GetDevice(&current) == kCudaSuccess && current == device) return;
  err_ = api_.SetDevice(device);
  if (err_ == kCudaSuccess) previous_ = current;  // -1 when it was unknown: nothing to restore
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) api_.SetDevice(previous_);
}

}  // namespace dcpds
