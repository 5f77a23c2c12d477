// Argument checks of the batched kernels (kernels.h), shared by the CPU and CUDA twins so both reject
// the same batches, before any job runs: a batch with one bad job changes nothing.
#pragma once

#include "kernels.h"

namespace compcomm::kernels::batch {

inline bool bad_sizes(int64_t n, int64_t padded) { return n < 0 || padded < n || padded % 8 != 0; }

inline bool bad_dtype(InputType t) {
  return t != InputType::kFloat32 && t != InputType::kFloat16 && t != InputType::kBFloat16;
}

inline bool bad(const CopyJob& j) { return j.bytes < 0 || (j.bytes > 0 && (j.src == nullptr || j.dst == nullptr)); }

inline bool bad(const WorkerJob& j) { return j.header == nullptr || bad_sizes(j.n, j.padded) || bad_dtype(j.dtype); }

inline bool bad(const ServerJob& j, int world) { return world < 1 || j.chunk < 0 || j.chunk % 8 != 0; }

inline bool bad(const CommitJob& j, int world) {
  return bad_sizes(j.n, j.padded) || world < 1 || j.padded % (8 * world) != 0 || bad_dtype(j.dtype);
}

inline bool bad(const GateJob& j) { return j.scales == nullptr; }

// Whether any job of the batch is bad (extra arguments are passed on to bad()).
template <class Job, class... A>
bool any_bad(const Job* jobs, int64_t count, A... a) {
  if (count < 0 || (count > 0 && jobs == nullptr)) return true;
  for (int64_t i = 0; i < count; ++i)
    if (bad(jobs[i], a...)) return true;
  return false;
}

}  // namespace compcomm::kernels::batch
