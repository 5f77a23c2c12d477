// Stands in for the CUDA kernels in builds without a CUDA toolkit: every call reports kNotBuilt.
#include "kernels.h"

namespace compcomm::kernels {
namespace cuda {
bool built() { return false; }
size_t scale_workspace_bytes(int64_t) { return 0; }
Status worker_scale_pack(const void*, InputType, int64_t, const float*, int64_t, float*, uint8_t*, void*,
                         Stream) {
  return Status::kNotBuilt;
}
Status server_scale_pack(const uint8_t*, const float*, int64_t, int, const float*, int64_t, float*,
                         uint8_t*, void*, Stream) {
  return Status::kNotBuilt;
}
Status server_update(const uint8_t*, const float*, int64_t, int, float*, int64_t, const float*, Stream,
                     const float*, int64_t) {
  return Status::kNotBuilt;
}
Status worker_update_decompress(void*, InputType, int64_t, float*, int64_t, const float*, const float*,
                                int64_t, const uint8_t*, int64_t, int, Stream, const float*, int64_t) {
  return Status::kNotBuilt;
}
Status write_header(ExchangeHeader*, int64_t, int64_t, int32_t, uint32_t, Stream) {
  return Status::kNotBuilt;
}
Status decompress(const float*, const uint8_t*, int64_t, float*, Stream, const float*, int64_t, int) {
  return Status::kNotBuilt;
}
Status worker_scale_pack_header(const void*, InputType, int64_t, const float*, int64_t, ExchangeHeader*, int32_t,
                                uint32_t, uint8_t*, void*, Stream, HeaderNotice*, uint64_t) {
  return Status::kNotBuilt;
}
Status commit(const uint8_t*, const float*, int64_t, float*, const float*, void*, InputType, int64_t, float*, int64_t,
              const float*, const float*, int64_t, const uint8_t*, int64_t, int, Stream, const float*, int64_t) {
  return Status::kNotBuilt;
}
Status commit_gate(const int*, float*, int64_t, int, Stream) { return Status::kNotBuilt; }
}  // namespace cuda
Status device_copy(void*, const void*, int64_t, Stream) { return Status::kNotBuilt; }
Status device_fill(void*, int, int64_t, Stream) { return Status::kNotBuilt; }
ScopedDevice::ScopedDevice(int) {}
ScopedDevice::~ScopedDevice() {}
Status stream_sync(Stream) { return Status::kNotBuilt; }
Status host_alloc(void**, int64_t) { return Status::kNotBuilt; }
void host_free(void*) {}
Status host_alloc_mapped(void**, void**, int64_t) { return Status::kNotBuilt; }
Status stream_idle(Stream, bool*) { return Status::kNotBuilt; }
Status stream_capturing(Stream, bool*) { return Status::kNotBuilt; }
}  // namespace compcomm::kernels

// The batched kernels (kernels.h): kNotBuilt too.
namespace compcomm::kernels::cuda {
Status batch_copy(const CopyJob*, int64_t, Stream) { return Status::kNotBuilt; }
Status worker_scale_pack_header_many(const WorkerJob*, int64_t, uint32_t, Stream) { return Status::kNotBuilt; }
Status server_scale_pack_many(const ServerJob*, int64_t, int, Stream) { return Status::kNotBuilt; }
Status commit_many(const CommitJob*, int64_t, int, Stream) { return Status::kNotBuilt; }
Status commit_gate_many(const int*, const GateJob*, int64_t, int, Stream) { return Status::kNotBuilt; }
}  // namespace compcomm::kernels::cuda
