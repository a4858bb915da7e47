// The CUDA runtime, loaded at run time with dlopen: no CUDA header or toolkit at build time, so
// one build serves CPU-only and GPU machines. Only the few entry points the engine needs are
// declared, with the types and constant values of the CUDA runtime API.
#pragma once

#include <cstddef>
#include <string>

namespace dcpds {

using cudaError = int;  // cudaError_t
using CudaStream = void*;  // cudaStream_t (0: the legacy default stream of the current device)
using CudaEvent = void*;   // cudaEvent_t

constexpr cudaError kCudaSuccess = 0;
constexpr cudaError kCudaErrorNotReady = 600;

constexpr int kCudaMemcpyHostToDevice = 1;
constexpr int kCudaMemcpyDeviceToHost = 2;
constexpr int kCudaMemcpyDeviceToDevice = 3;
constexpr int kCudaMemcpyDefault = 4;
constexpr unsigned kCudaHostRegisterDefault = 0;
constexpr unsigned kCudaHostRegisterPortable = 1;  // pinned for every context, not just the current one
constexpr unsigned kCudaEventBlockingSync = 1;     // cudaEventSynchronize sleeps instead of spinning
constexpr unsigned kCudaEventDisableTiming = 2;
constexpr unsigned kCudaStreamNonBlocking = 1;

// Entry points of one loaded runtime library. Loaded once per path and never unloaded (the
// runtime's own threads and PyTorch's use of it outlive any engine).
struct CudaApi {
  std::string path;  // the file the functions come from

  cudaError (*GetDeviceCount)(int*) = nullptr;
  cudaError (*SetDevice)(int) = nullptr;
  cudaError (*GetDevice)(int*) = nullptr;
  cudaError (*HostRegister)(void*, size_t, unsigned) = nullptr;
  cudaError (*HostUnregister)(void*) = nullptr;
  cudaError (*StreamCreateWithFlags)(CudaStream*, unsigned) = nullptr;
  cudaError (*StreamDestroy)(CudaStream) = nullptr;
  cudaError (*EventCreateWithFlags)(CudaEvent*, unsigned) = nullptr;
  cudaError (*EventDestroy)(CudaEvent) = nullptr;
  cudaError (*EventRecord)(CudaEvent, CudaStream) = nullptr;
  cudaError (*EventQuery)(CudaEvent) = nullptr;
  cudaError (*EventSynchronize)(CudaEvent) = nullptr;
  cudaError (*StreamWaitEvent)(CudaStream, CudaEvent, unsigned) = nullptr;
  cudaError (*MemcpyAsync)(void*, const void*, size_t, int, CudaStream) = nullptr;
  cudaError (*StreamSynchronize)(CudaStream) = nullptr;
  const char* (*GetErrorString)(cudaError) = nullptr;

  // "<cudaGetErrorString text> (CUDA error <n>)".
  std::string error_text(cudaError err) const;
};

// The environment variable that names the runtime library to load; "none" forces CPU mode.
constexpr const char* kCudartEnv = "DCP_DATASTATES_CUDART";

// Finds and loads the runtime: $DCP_DATASTATES_CUDART when set (and nothing else), otherwise a
// libcudart already mapped into this process (PyTorch's), otherwise libcudart.so,
// libcudart.so.13, libcudart.so.12. Returns nullptr and sets *why when none can be used.
const CudaApi* load_cuda_runtime(std::string* why);

// Makes `device` the calling thread's current device for the guard's lifetime, then restores
// the previous one (the caller may be PyTorch's training thread, whose device must not move).
class DeviceGuard {
 public:
  DeviceGuard(const CudaApi& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError error() const { return err_; }  // of cudaSetDevice; kCudaSuccess when it is current

 private:
  const CudaApi& api_;
  int previous_ = -1;
  cudaError err_ = kCudaSuccess;
};

}  // namespace dcpds
