// CPU twins of the batched kernels (kernels.h): each is a loop over the single call it batches, so
// they are the oracle the CUDA batches are tested against (tests/test_kernels.py, test_cuda.py).
#include <cstring>

#include "batch_jobs.h"
#include "kernels.h"

namespace compcomm::kernels::cpu {

Status batch_copy(const CopyJob* jobs, int64_t count, Stream) {
  if (batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  for (int64_t i = 0; i < count; ++i)
    if (jobs[i].bytes > 0 && jobs[i].dst != jobs[i].src)
      std::memcpy(jobs[i].dst, jobs[i].src, static_cast<size_t>(jobs[i].bytes));
  return Status::kSuccess;
}

Status worker_scale_pack_header_many(const WorkerJob* jobs, int64_t count, uint32_t magic, Stream stream) {
  if (batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  for (int64_t i = 0; i < count; ++i) {
    const WorkerJob& j = jobs[i];
    const Status s = worker_scale_pack_header(j.m, j.dtype, j.n, j.error, j.padded, j.header, j.header_dtype, magic,
                                              j.signs, j.workspace, stream);
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

Status server_scale_pack_many(const ServerJob* jobs, int64_t count, int world, Stream stream) {
  if (batch::any_bad(jobs, count, world)) return Status::kInvalidArgument;
  for (int64_t i = 0; i < count; ++i) {
    const ServerJob& j = jobs[i];
    const Status s = server_scale_pack(j.signs, j.scales, j.scale_stride, world, j.server_error, j.chunk, j.scale,
                                       j.packed, j.workspace, stream);
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

Status commit_many(const CommitJob* jobs, int64_t count, int world, Stream stream) {
  if (batch::any_bad(jobs, count, world)) return Status::kInvalidArgument;
  for (int64_t i = 0; i < count; ++i) {
    const CommitJob& j = jobs[i];
    const Status s = commit(j.signs, j.scales, j.scale_stride, j.server_error, j.server_scale, j.m, j.dtype, j.n,
                            j.error, j.padded, j.scale, j.out_scales, j.out_scale_stride, j.out_signs,
                            j.out_sign_stride, world, stream, j.guard, j.guard_stride);
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

Status commit_gate_many(const int* abort_flag, const GateJob* jobs, int64_t count, int world, Stream stream) {
  if (abort_flag == nullptr || world < 0 || batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  // Read once for the whole batch (as the device twin): a concurrent setter may be another thread.
  if (*static_cast<const volatile int*>(abort_flag) == 0) return Status::kSuccess;
  static const int kRaised = 1;
  for (int64_t i = 0; i < count; ++i) commit_gate(&kRaised, jobs[i].scales, jobs[i].stride, world, stream);
  return Status::kSuccess;
}

}  // namespace compcomm::kernels::cpu
