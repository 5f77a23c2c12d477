// Host staging of the MPI communicator (see mpi_comm.h): pinned host buffers and CUDA events that
// device buffers pass through when the MPI library cannot read device memory. Allocated on the first
// staged call, grown on demand and reused; `done` keeps a call from refilling them while the previous
// call's copy back still reads them. Internal to cpp/mpi/.
#pragma once

#include <cstdint>
#include <vector>

#ifdef COMPCOMM_MPI_CUDA
#include <cuda_runtime_api.h>
#endif

#include "mpi_comm.h"

namespace compcomm {

#ifdef COMPCOMM_MPI_CUDA
struct MpiCommunicator::Staging {
  void* host[2] = {nullptr, nullptr};
  int64_t capacity[2] = {0, 0};
  int device = -1;
  cudaEvent_t done = nullptr;        // recorded after the last copy back; staging is free once it fired
  std::vector<cudaEvent_t> events;   // per-chunk "copied to host" events

  void release_events() {
    if (done) cudaEventDestroy(done);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    done = nullptr;
    events.clear();
  }
  ~Staging() {
    if (done) cudaEventSynchronize(done);
    release_events();
    for (void* p : host)
      if (p) cudaFreeHost(p);
  }
};
#else
struct MpiCommunicator::Staging {};
#endif  // COMPCOMM_MPI_CUDA

}  // namespace compcomm
