// 1-bit compression kernels. Each exists twice with the same signature: in namespace cpu (the fallback
// and the test oracle) and in namespace cuda (built when a CUDA toolkit is found). They take raw pointers,
// counts and a stream, return a Status, never allocate and never throw. No framework, binding or
// communication headers may be included here.
//
// Notation (ONEBIT_SPEC.md section a): m holds n input elements of `dtype`; the worker error e and the
// padded input have P elements (P % (8*W) == 0, P >= n, m_k = +0 for k >= n); x = fl32(m + e).
// The chunk owned by each server rank has C = P/W elements. Signs are packed 8 per byte, element 8i+j
// in bit 7-j (MSB first); bit 1 means +1: v >= 0, -0.0 and NaN; bit 0 means v < 0.
// "Scales" are fp32 values in memory of the kernel's device (so GPU work never syncs with the host).
// Strided scale arrays let the caller keep scales inside the records it exchanges.
#pragma once

#include <cstddef>
#include <cstdint>

namespace compcomm::kernels {

enum class Status : int { kSuccess = 0, kInvalidArgument = 1, kCudaError = 2, kNotBuilt = 3 };
enum class InputType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
using Stream = void*;

// The 32-byte header every rank all-gathers at the start of compressed_allreduce (kept here because on
// GPU a kernel fills it in device memory).
struct ExchangeHeader {
  float scale;
  uint32_t flags;  // bit 0: scale is not finite
  int64_t numel;
  int64_t padded;
  int32_t dtype;
  uint32_t magic;
};
static_assert(sizeof(ExchangeHeader) == 32, "ExchangeHeader is exchanged as 32 raw bytes");

// Where a worker kernel also posts its header for a host thread that waits on it without syncing the
// stream (on GPU: page-locked host memory mapped into the device, host_alloc_mapped). A seqlock with
// the caller's sequence number (unique per call): begin = seq, then (after a system-wide fence) the
// header, then tag = seq. A reader that sees its own number in tag, then copies the header, then
// still sees it in begin, has that call's header whole; a late writer of an earlier call that
// overwrote part of it has left its own number in begin (notice.h, read_notice).
struct HeaderNotice {
  ExchangeHeader header;
  uint64_t tag;
  uint64_t begin;
  uint64_t reserved[2];
};
static_assert(sizeof(HeaderNotice) == 64, "HeaderNotice is one 64-byte line");

// Guard: the two commit kernels (server_update, worker_update_decompress) take an optional array of
// `world` scales, guard[i*guard_stride]; when it is given and any of them is not finite, the call changes
// nothing. This lets a caller that does not inspect the exchanged scales on the host (CUDA-graph capture)
// still leave its state untouched when some rank's input was not finite.

// ---- batches: one call (one launch per phase on GPU, a few for very long batches) for the work of
// many buckets. Each job is exactly what the single call of the same name does, with the same bits
// (on GPU every bucket keeps the blocks and thread partition its own launch would have, so even its
// fp64 norm sums in the same order). The job arrays are read on the host before the call returns (on
// GPU they travel as kernel arguments), so the caller may reuse them at once. Jobs must not overlap
// each other's outputs (they run concurrently on GPU). ----

// One copy of a batch_copy: `bytes` bytes from src to dst (both device memory on GPU).
struct CopyJob {
  const void* src;
  void* dst;
  int64_t bytes;
};

// One bucket of worker_scale_pack_header_many (the arguments of worker_scale_pack_header, no notice).
struct WorkerJob {
  const void* m;
  const float* error;
  uint8_t* signs;
  void* workspace;
  ExchangeHeader* header;
  int64_t n, padded;
  InputType dtype;
  int32_t header_dtype;
};

// One bucket of server_scale_pack_many (the arguments of server_scale_pack; world is the batch's).
struct ServerJob {
  const uint8_t* signs;
  const float* scales;
  int64_t scale_stride;
  const float* server_error;
  int64_t chunk;
  float* scale;
  uint8_t* packed;
  void* workspace;
};

// One bucket of commit_many (the arguments of commit; world is the batch's).
struct CommitJob {
  const uint8_t* signs;
  const float* scales;
  int64_t scale_stride;
  float* server_error;
  const float* server_scale;
  void* m;
  int64_t n;
  float* error;
  int64_t padded;
  const float* scale;
  const float* out_scales;
  int64_t out_scale_stride;
  const uint8_t* out_signs;
  int64_t out_sign_stride;
  const float* guard;
  int64_t guard_stride;
  InputType dtype;
};

// One bucket of commit_gate_many: its `world` scales at scales[i*stride].
struct GateJob {
  float* scales;
  int64_t stride;
};

#define COMPCOMM_BATCH_DECLS                                                                         \
  /* memcpy of every job, in any order. */                                                           \
  Status batch_copy(const CopyJob* jobs, int64_t count, Stream stream);                             \
  /* worker_scale_pack_header of every job, with `magic`. */                                         \
  Status worker_scale_pack_header_many(const WorkerJob* jobs, int64_t count, uint32_t magic,        \
                                       Stream stream);                                              \
  /* server_scale_pack of every job. */                                                              \
  Status server_scale_pack_many(const ServerJob* jobs, int64_t count, int world, Stream stream);     \
  /* commit of every job (each under its own guard). */                                             \
  Status commit_many(const CommitJob* jobs, int64_t count, int world, Stream stream);               \
  /* commit_gate of every job under one reading of *abort_flag. */                                   \
  Status commit_gate_many(const int* abort_flag, const GateJob* jobs, int64_t count, int world,     \
                          Stream stream);

#define COMPCOMM_KERNEL_DECLS                                                                         \
  /* Scratch bytes the *_scale_pack calls need for P (or C) elements. On GPU the scratch must be           \
     zero-filled before its first use; every call leaves it zero-filled again. */                     \
  size_t scale_workspace_bytes(int64_t count);                                                       \
  /* (server_update, worker_update_decompress and write_header: the core calls the fused commit and  \
     worker_scale_pack_header; these stay as their parts, tested against them.) */                   \
  /* Commit: server_error_k = c_k - (*scale) * s(c_k), c as in server_scale_pack. Guard (above). */ \
  Status server_update(const uint8_t* signs, const float* scales, int64_t scale_stride, int world,    \
                       float* server_error, int64_t chunk, const float* scale, Stream stream,         \
                       const float* guard = nullptr, int64_t guard_stride = 0);                      \
  /* The commit step. For k < P: e_k = x_k - (*scale) * s(x_k). For k < n: m_k = out_k converted to   \
     dtype, where out_k = scale_j * (bit ? +1 : -1) for chunk j = k / C, with scale_j =                \
     out_scales[j*out_scale_stride] and the bit from out_signs + j*out_sign_stride. Guard (above). */  \
  Status worker_update_decompress(void* m, InputType dtype, int64_t n, float* error, int64_t padded, \
                                  const float* scale, const float* out_scales,                        \
                                  int64_t out_scale_stride, const uint8_t* out_signs,                 \
                                  int64_t out_sign_stride, int world, Stream stream,                  \
                                  const float* guard = nullptr, int64_t guard_stride = 0);            \
  /* Pass 1, read-only on m and e: *scale = fl32(fl32(sqrt(sum_k x_k^2)) / fl32(sqrt(P))) with the    \
     sum in fp64 (0 if P = 0), and signs[P/8] = packed s(x) (the signs do not depend on the scale). */ \
  Status worker_scale_pack(const void* m, InputType dtype, int64_t n, const float* error,            \
                           int64_t padded, float* scale, uint8_t* signs, void* workspace,             \
                           Stream stream);                                                            \
  /* Server pass, read-only on server_error: c_k = sum_i s_ik * fl32(scale_i * fl32(1/W)) (ranks in   \
     order, fp32) + server_error_k, where s_i is row i of signs[W][C/8] and scale_i =                 \
     scales[i*scale_stride]; *scale = fl32(fl32(||c||) / fl32(sqrt(C))), packed[C/8] = s(c). */       \
  Status server_scale_pack(const uint8_t* signs, const float* scales, int64_t scale_stride,           \
                           int world, const float* server_error, int64_t chunk, float* scale,         \
                           uint8_t* packed, void* workspace, Stream stream);                          \
  /* header->{flags = isfinite(header->scale) ? 0 : 1, numel, padded, dtype, magic} (the scale field   \
     is left as the worker scale kernel wrote it). Runs where the header lives. */                    \
  Status write_header(ExchangeHeader* header, int64_t numel, int64_t padded, int32_t dtype,          \
                      uint32_t magic, Stream stream);                                                 \
  /* out_k = (*scale) * (bit k of packed ? +1 : -1) for k < count: one chunk of a compressed           \
     reduce-scatter's result, from the server's scale and packed signs. Guard (above). */             \
  Status decompress(const float* scale, const uint8_t* packed, int64_t count, float* out,            \
                    Stream stream, const float* guard = nullptr, int64_t guard_stride = 0,            \
                    int guard_count = 0);                                                             \
  /* Pass 1 and the header in one launch: worker_scale_pack(m, dtype, n, error, padded,              \
     &header->scale, signs, workspace), then write_header(header, n, padded, header_dtype, magic).    \
     With `notice`, the thread that wrote the header also posts it there, tagged `seq` (above). */   \
  Status worker_scale_pack_header(const void* m, InputType dtype, int64_t n, const float* error,     \
                                  int64_t padded, ExchangeHeader* header, int32_t header_dtype,      \
                                  uint32_t magic, uint8_t* signs, void* workspace, Stream stream,    \
                                  HeaderNotice* notice = nullptr, uint64_t seq = 0);                 \
  /* The whole commit in one launch: server_update(signs, scales, scale_stride, world, server_error, \
     padded / world, server_scale) and worker_update_decompress(m, dtype, n, error, padded, scale,    \
     out_scales, out_scale_stride, out_signs, out_sign_stride, world), under one guard: both write   \
     or neither does. Same bits as the two calls. */                                                 \
  Status commit(const uint8_t* signs, const float* scales, int64_t scale_stride, float* server_error, \
                const float* server_scale, void* m, InputType dtype, int64_t n, float* error,        \
                int64_t padded, const float* scale, const float* out_scales, int64_t out_scale_stride, \
                const uint8_t* out_signs, int64_t out_sign_stride, int world, Stream stream,          \
                const float* guard = nullptr, int64_t guard_stride = 0);                             \
  /* Commit gate: if *abort_flag != 0, scales[i*stride] = NaN for i < world (the commit kernels given  \
     those scales as their guard then write nothing); else nothing. On GPU abort_flag may be mapped   \
     host memory that another thread sets; it is read once, when the gate runs in stream order. */    \
  Status commit_gate(const int* abort_flag, float* scales, int64_t stride, int world, Stream stream);

namespace cpu {
COMPCOMM_KERNEL_DECLS
COMPCOMM_BATCH_DECLS
}  // namespace cpu

namespace cuda {
COMPCOMM_KERNEL_DECLS
COMPCOMM_BATCH_DECLS
// Whether the CUDA kernels were compiled into this build.
bool built();
}  // namespace cuda

#undef COMPCOMM_KERNEL_DECLS
#undef COMPCOMM_BATCH_DECLS

// Device-to-device (or host<->device) copy of `bytes` on `stream`; kNotBuilt without CUDA.
Status device_copy(void* dst, const void* src, int64_t bytes, Stream stream);
// Waits for the work queued on `stream` (used only where the caller asked for a host-side check).
Status stream_sync(Stream stream);
// Makes `device` the calling thread's current CUDA device while it lives (kernels launch on the
// current device; a communication thread's is device 0). No-op for device < 0 or without CUDA.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int prev_ = -1;
};

// Page-locked host memory (device-to-host copies into it are direct and asynchronous); kNotBuilt
// without CUDA. host_free(nullptr) is a no-op; errors of host_free are ignored (it may run at exit).
Status host_alloc(void** ptr, int64_t bytes);
void host_free(void* ptr);
// Page-locked host memory mapped into every device's address space (a kernel writes *device_ptr, the
// host reads *host_ptr); freed with host_free(host_ptr). kNotBuilt without CUDA.
Status host_alloc_mapped(void** host_ptr, void** device_ptr, int64_t bytes);
// *idle = whether every operation queued on `stream` has finished (cudaStreamQuery); kCudaError when
// the stream reports an error (a failed kernel, a capture that a query invalidates). kNotBuilt without CUDA.
Status stream_idle(Stream stream, bool* idle);
// *capturing = whether `stream` is being captured into a CUDA graph (its work does not run now).
Status stream_capturing(Stream stream, bool* capturing);

// Sets `bytes` bytes of device memory at dst to `value` on `stream`; kNotBuilt without CUDA.
Status device_fill(void* dst, int value, int64_t bytes, Stream stream);

}  // namespace compcomm::kernels
