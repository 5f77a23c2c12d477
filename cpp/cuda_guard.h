// CUDA runtime helpers shared by the backends (cpp/nccl, cpp/mpi): the error check and the device
// guards. Host code only: cpp/kernels/ keeps its own (kernels return a status and never throw).
#pragma once

#include <cuda_runtime_api.h>

#include "common.h"

namespace compcomm {

// Where a CUDA call was made, for the error: the backend ("nccl", "mpi"), the collective, the rank.
// Holds pointers only: the strings must outlive it (string literals, the caller's call name).
struct CudaCallSite {
  const char* backend;
  const char* call;
  int rank;
};

// The BackendError of a failed CUDA call (backend "cuda", code: the cudaError_t). Message:
// "[rank R] BACKEND CALL: WHAT failed: NAME: TEXT", or "[rank R] BACKEND CALL: CUDA error NAME: TEXT"
// when `what` (the failing expression) is null.
[[noreturn]] inline void throw_cuda_error(cudaError_t e, const CudaCallSite& at, const char* what) {
  std::string msg = what ? detail::concat("[rank ", at.rank, "] ", at.backend, " ", at.call, ": ",
                                          what, " failed: ")
                         : detail::concat("[rank ", at.rank, "] ", at.backend, " ", at.call,
                                          ": CUDA error ");
  msg += detail::concat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  throw BackendError(msg, at.call, "cuda", static_cast<int>(e), at.rank);
}

// Throws unless `e` is cudaSuccess; for a status already in hand (COMPCOMM_CHECK_CUDA for a call).
inline void check_cuda(cudaError_t e, const CudaCallSite& at, const char* what = nullptr) {
  if (e != cudaSuccess) throw_cuda_error(e, at, what);
}

// Makes `device` current for the scope and restores the previous device afterwards. Throws (see
// throw_cuda_error) when the current device cannot be read or set.
class DeviceGuard {
 public:
  DeviceGuard(int device, const CudaCallSite& at) {
    check_cuda(cudaGetDevice(&prev_), at);
    if (prev_ != device)
      check_cuda(cudaSetDevice(device), at);
    else
      prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// Like DeviceGuard but never throws and clears the error it may leave: for abort and teardown
// paths, which must always complete, and for callers whose next CUDA call reports the failure.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess || prev_ == device)
      prev_ = -1;
    else if (cudaSetDevice(device) != cudaSuccess)
      prev_ = -1;
    cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace compcomm

// Checks a CUDA runtime call; on failure throws the BackendError of throw_cuda_error, naming the
// expression. `site` is a CudaCallSite (a variable: braces in a macro argument split it).
#define COMPCOMM_CHECK_CUDA(expr, site) ::compcomm::check_cuda((expr), (site), #expr)
