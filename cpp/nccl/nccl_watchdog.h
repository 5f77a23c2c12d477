// The watchdog of NcclCommunicator (internal to cpp/nccl/; the design is in nccl_comm.h's "Faults").
// After each collective outside graph capture, track_locked() records an event on the caller's
// stream with the call's deadline; a thread (watchdog_loop) polls those events, the deadline of a
// call stuck inside NCCL (blocking mode) and NCCL's asynchronous error, and aborts the communicator
// on the first fault.
#pragma once

#include <cuda_runtime_api.h>

#include "nccl_comm.h"

namespace compcomm::nccl {

struct NcclCommunicator::Pending {
  cudaEvent_t event;
  double deadline;
  double timeout_s;
  const char* call;
};

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Whether `stream` is being captured into a CUDA graph (true when that cannot be asked: events are
// then neither recorded nor queried).
bool capturing(void* stream);

}  // namespace compcomm::nccl
