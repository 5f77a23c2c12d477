// CUDA twins of the 1-bit compression kernels (kernels.h is the contract, cpu_kernels.cpp the oracle).
//
// How the work is laid out: one thread handles one group of 8 elements -- one packed sign byte -- per
// grid-stride iteration. fp32 inputs are read as two 16-byte vectors, fp16/bf16 as one, and the fp32
// errors as two, whenever the pointers are 16-byte aligned (a template flag picks scalar loads
// otherwise); a group that straddles n is read element by element. Everything is memory-bound, so the
// grid is a few resident blocks per SM and each thread keeps 64 bytes in flight.
//
// Norms are accumulated in fp64 (as the CPU twin does): per thread, then a warp-shuffle + shared-memory
// block reduction, one partial per block in the caller's scratch; the last block to finish (an atomic
// ticket) sums the partials in a fixed order and writes the fp32 scale. So a norm is one launch, is
// deterministic, and never syncs with the host. That last block also resets the ticket, which is why
// the scratch must be zero-filled before its first use (it is left zero-filled after every call).
//
// The sums that decide signs and errors are done in the same fp32 order as on the CPU (products by +-1
// are exact, so FMA contraction cannot change a result): packed signs and errors are bit-identical to
// the CPU twin; scales may differ only through the order of the fp64 sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "batch_jobs.h"
#include "kernels.h"

namespace compcomm::kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxReduceBlocks = 1024;
constexpr size_t kCounterOffset = kMaxReduceBlocks * sizeof(double);  // scratch: partials, then ticket
constexpr size_t kScratchBytes = kCounterOffset + 16;

enum : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <int kType_, bool kVec_>
struct Tag {
  static constexpr int kType = kType_;
  static constexpr bool kVec = kVec_;
};

int sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  static int cache[128] = {0};  // a benign race: every writer stores the same value
  if (dev >= 0 && dev < 128 && cache[dev] > 0) return cache[dev];
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) v = 132;
  if (dev >= 0 && dev < 128) cache[dev] = v;
  return v;
}

// Blocks for `groups` groups of 8: enough to cover the data, at most 8 resident 256-thread blocks per SM.
int grid_for(int64_t groups, bool reduce) {
  int64_t blocks = (groups + kThreads - 1) / kThreads;
  int64_t cap = static_cast<int64_t>(sm_count()) * 8;
  if (reduce && cap > kMaxReduceBlocks) cap = kMaxReduceBlocks;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks);
}

Status launched() { return cudaGetLastError() == cudaSuccess ? Status::kSuccess : Status::kCudaError; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool bad_sizes(int64_t n, int64_t padded) { return n < 0 || padded < n || padded % 8 != 0; }
bool bad_chunk(int world, int64_t chunk) { return world < 1 || chunk < 0 || chunk % 8 != 0; }

// ---- element access ------------------------------------------------------------------------------

template <int kType>
__device__ __forceinline__ float from_bits(uint32_t h) {
  if constexpr (kType == kF16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  } else {
    return __uint_as_float(h << 16);
  }
}

template <int kType>
__device__ __forceinline__ float load1(const void* m, int64_t k) {
  if constexpr (kType == kF32) {
    return static_cast<const float*>(m)[k];
  } else {
    return from_bits<kType>(static_cast<const uint16_t*>(m)[k]);
  }
}

// x[0..8) = m[k0..k0+8) as fp32, +0 past n.
template <int kType, bool kVec>
__device__ __forceinline__ void load_m8(const void* m, int64_t n, int64_t k0, float* x) {
  if (kVec && k0 + 8 <= n) {
    if constexpr (kType == kF32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(m) + k0);
      const float4 a = p[0], b = p[1];
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    } else {
      const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(m) + k0);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = from_bits<kType>(w[i] & 0xffffu);
        x[2 * i + 1] = from_bits<kType>(w[i] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = k0 + i < n ? load1<kType>(m, k0 + i) : 0.0f;
  }
}

template <bool kVec>
__device__ __forceinline__ void load_f8(const float* p, int64_t k0, float* y) {
  if (kVec) {
    const float4 a = reinterpret_cast<const float4*>(p + k0)[0];
    const float4 b = reinterpret_cast<const float4*>(p + k0)[1];
    y[0] = a.x, y[1] = a.y, y[2] = a.z, y[3] = a.w, y[4] = b.x, y[5] = b.y, y[6] = b.z, y[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = p[k0 + i];
  }
}

template <bool kVec>
__device__ __forceinline__ void store_f8(float* p, int64_t k0, const float* y) {
  if (kVec) {
    reinterpret_cast<float4*>(p + k0)[0] = make_float4(y[0], y[1], y[2], y[3]);
    reinterpret_cast<float4*>(p + k0)[1] = make_float4(y[4], y[5], y[6], y[7]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p[k0 + i] = y[i];
  }
}

// Same rounding as the CPU twin (round to nearest even; NaN: quiet, with its sign and top 10
// mantissa bits, as float_to_half and F16C's vcvtps2ph).
__device__ __forceinline__ uint16_t to_half_bits(float f) {
  if (isnan(f)) {
    const uint32_t x = __float_as_uint(f);
    return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7e00u | ((x & 0x7fffffu) >> 13));
  }
  return __half_as_ushort(__float2half_rn(f));
}
__device__ __forceinline__ uint16_t to_bf16_bits(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// m[k0..min(k0+8, n)) = bit(7-i) of `byte` ? tau : -tau, in the tensor's dtype.
template <int kType, bool kVec>
__device__ __forceinline__ void store_out8(void* m, int64_t n, int64_t k0, float tau, uint32_t byte) {
  if constexpr (kType == kF32) {
    float o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (byte >> (7 - i)) & 1u ? tau : -tau;
    float* p = static_cast<float*>(m);
    if (kVec && k0 + 8 <= n) {
      store_f8<true>(p, k0, o);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (k0 + i < n) p[k0 + i] = o[i];
    }
  } else {
    const uint32_t pos = kType == kF16 ? to_half_bits(tau) : to_bf16_bits(tau);
    const uint32_t neg = kType == kF16 ? to_half_bits(-tau) : to_bf16_bits(-tau);
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (byte >> (7 - i)) & 1u ? pos : neg;
    uint16_t* p = static_cast<uint16_t*>(m);
    if (kVec && k0 + 8 <= n) {
      *reinterpret_cast<uint4*>(p + k0) =
          make_uint4(o[0] | (o[1] << 16), o[2] | (o[3] << 16), o[4] | (o[5] << 16), o[6] | (o[7] << 16));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (k0 + i < n) p[k0 + i] = static_cast<uint16_t>(o[i]);
    }
  }
}

// Bit 7-i set unless x[i] < 0: +0, -0 and NaN pack as +1.
__device__ __forceinline__ uint8_t pack8(const float* x) {
  uint32_t b = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) b |= static_cast<uint32_t>(!(x[i] < 0.0f)) << (7 - i);
  return static_cast<uint8_t>(b);
}

__device__ __forceinline__ float sgn(float v) { return v < 0.0f ? -1.0f : 1.0f; }

__device__ __forceinline__ double sumsq8(const float* x) {
  double a = 0.0, b = 0.0;
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    a += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    b += static_cast<double>(x[i + 1]) * static_cast<double>(x[i + 1]);
  }
  return a + b;
}

// ---- reductions ----------------------------------------------------------------------------------

// Sum over the block (valid in thread 0). Every thread must call it.
__device__ double block_sum(double v, double* sh) {
  __syncthreads();  // sh may still be read by a previous call
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.0;
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// *scale = fl32(fl32(sqrt(sum)) / fl32(sqrt(count))) over all blocks' `acc`; see the file comment.
// Returns true in the one thread that wrote *scale (the caller may then read it back). `block` of
// `nblocks`: the caller's place among the blocks of this norm (a batched launch runs many norms).
__device__ bool finish_norm(double acc, void* scratch, float* scale, int64_t count, unsigned block,
                            unsigned nblocks) {
  __shared__ double sh[32];
  __shared__ bool last;
  double* partials = static_cast<double*>(scratch);
  unsigned* ticket = reinterpret_cast<unsigned*>(static_cast<char*>(scratch) + kCounterOffset);
  const double s = block_sum(acc, sh);
  if (threadIdx.x == 0) {
    partials[block] = s;
    __threadfence();
    last = atomicAdd(ticket, 1u) == nblocks - 1;
  }
  __syncthreads();
  if (!last) return false;
  __threadfence();
  double v = 0.0;
  for (unsigned i = threadIdx.x; i < nblocks; i += blockDim.x) v += __ldcg(&partials[i]);
  v = block_sum(v, sh);
  if (threadIdx.x == 0) {
    *scale = count == 0 ? 0.0f
                        : static_cast<float>(sqrt(v)) / static_cast<float>(sqrt(static_cast<double>(count)));
    *ticket = 0u;
    return true;
  }
  return false;
}

// Whether any guard scale is not finite (block-uniform). Every thread must call it.
__device__ bool guard_trips(const float* guard, int64_t stride, int world) {
  int bad = 0;
  if (guard != nullptr)
    for (int i = threadIdx.x; i < world; i += blockDim.x) bad |= !isfinite(guard[i * stride]);
  return __syncthreads_or(bad) != 0;
}

// ---- kernels -------------------------------------------------------------------------------------

// Posts *h to a notice in (mapped host) memory: begin, the header, then the tag, each after a
// system-wide fence, so a host thread that reads its tag there, then the header, then its tag again
// in begin has read this header whole (kernels.h, HeaderNotice; notice.h, read_notice).
__device__ void post_notice(const ExchangeHeader& h, HeaderNotice* notice, uint64_t seq) {
  *reinterpret_cast<volatile unsigned long long*>(&notice->begin) = seq;  // seqlock: begin first
  __threadfence_system();
  volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(&notice->header);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&h);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(ExchangeHeader) / 4); ++i) dst[i] = src[i];
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(&notice->tag) = seq;
}

// With `header` (whose scale field is `scale`), the thread that wrote the scale also fills in the
// rest of the header, as header_kernel would: one launch instead of two. With `notice` it also posts
// the header there: the host learns the verdict as soon as this kernel's last block is done, without
// waiting for the rest of the stream.
// Block `block` of `nblocks` (the whole grid of a single call; a bucket's share of a batched one).
template <int kType, bool kVec>
__device__ __forceinline__ void worker_body(const void* __restrict__ m, int64_t n, const float* __restrict__ e,
                                            int64_t padded, uint8_t* __restrict__ signs, float* scale,
                                            void* scratch, ExchangeHeader* header, int32_t header_dtype,
                                            uint32_t magic, HeaderNotice* notice, uint64_t seq, unsigned block,
                                            unsigned nblocks) {
  const int64_t groups = padded / 8;
  double acc = 0.0;
  for (int64_t g = block * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(nblocks) * blockDim.x) {
    float x[8], y[8];
    load_m8<kType, kVec>(m, n, 8 * g, x);
    load_f8<kVec>(e, 8 * g, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] += y[i];
    acc += sumsq8(x);
    signs[g] = pack8(x);
  }
  if (finish_norm(acc, scratch, scale, padded, block, nblocks) && header != nullptr) {
    ExchangeHeader h;
    h.scale = *scale;
    h.flags = isfinite(h.scale) ? 0u : 1u;
    h.numel = n;
    h.padded = padded;
    h.dtype = header_dtype;
    h.magic = magic;
    header->flags = h.flags;
    header->numel = n;
    header->padded = padded;
    header->dtype = header_dtype;
    header->magic = magic;
    if (notice != nullptr) post_notice(h, notice, seq);
  }
}

template <int kType, bool kVec>
__global__ void __launch_bounds__(kThreads)
    worker_kernel(const void* __restrict__ m, int64_t n, const float* __restrict__ e, int64_t padded,
                  uint8_t* __restrict__ signs, float* scale, void* scratch, ExchangeHeader* header,
                  int32_t header_dtype, uint32_t magic, HeaderNotice* notice, uint64_t seq) {
  worker_body<kType, kVec>(m, n, e, padded, signs, scale, scratch, header, header_dtype, magic, notice, seq,
                           blockIdx.x, gridDim.x);
}

enum : int { kServerScale = 1, kServerPack = 2, kServerUpdate = 4 };

// c = sum_i s_i * fl32(scale_i * fl32(1/W)) (ranks in order) + server_error, per group of 8.
template <bool kVec, int kMode>
__device__ __forceinline__ void server_body(const uint8_t* __restrict__ signs, const float* scales, int64_t stride,
                                            int world, float* serr, int64_t chunk, float* scale_out,
                                            uint8_t* __restrict__ packed, const float* tau_in, const float* guard,
                                            int64_t guard_stride, void* scratch, unsigned block,
                                            unsigned nblocks) {
  if (kMode & kServerUpdate) {
    if (guard_trips(guard, guard_stride, world)) return;
  }
  const int64_t groups = chunk / 8;
  const float inv_w = 1.0f / static_cast<float>(world);
  const float tau = (kMode & kServerUpdate) ? *tau_in : 0.0f;
  double acc = 0.0;
  for (int64_t g = block * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(nblocks) * blockDim.x) {
    float c[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < world; ++i) {
      const float a = scales[i * stride] * inv_w;
      const uint32_t byte = signs[i * groups + g];
#pragma unroll
      for (int j = 0; j < 8; ++j) c[j] += (byte >> (7 - j)) & 1u ? a : -a;
    }
    float s[8];
    load_f8<kVec>(serr, 8 * g, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] += s[j];
    if (kMode & kServerScale) acc += sumsq8(c);
    if (kMode & kServerPack) packed[g] = pack8(c);
    if (kMode & kServerUpdate) {
#pragma unroll
      for (int j = 0; j < 8; ++j) s[j] = c[j] - tau * sgn(c[j]);
      store_f8<kVec>(serr, 8 * g, s);
    }
  }
  if (kMode & kServerScale) finish_norm(acc, scratch, scale_out, chunk, block, nblocks);
}

template <bool kVec, int kMode>
__global__ void __launch_bounds__(kThreads)
    server_kernel(const uint8_t* __restrict__ signs, const float* scales, int64_t stride, int world,
                  float* serr, int64_t chunk, float* scale_out, uint8_t* __restrict__ packed,
                  const float* tau_in, const float* guard, int64_t guard_stride, void* scratch) {
  server_body<kVec, kMode>(signs, scales, stride, world, serr, chunk, scale_out, packed, tau_in, guard,
                           guard_stride, scratch, blockIdx.x, gridDim.x);
}

template <int kType, bool kVec>
__global__ void __launch_bounds__(kThreads)
    commit_kernel(void* m, int64_t n, float* e, int64_t padded, const float* scale, const float* out_scales,
                  int64_t oss, const uint8_t* out_signs, int64_t osb, int world, const float* guard,
                  int64_t guard_stride) {
  if (guard_trips(guard, guard_stride, world)) return;
  const float sigma = *scale;
  const int64_t groups = padded / 8, chunk_groups = groups / world;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = world == 1 ? 0 : g / chunk_groups, b = g - j * chunk_groups;
    float x[8], y[8];
    load_m8<kType, kVec>(m, n, 8 * g, x);
    load_f8<kVec>(e, 8 * g, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] += y[i];
      y[i] = x[i] - sigma * sgn(x[i]);
    }
    store_f8<kVec>(e, 8 * g, y);
    store_out8<kType, kVec>(m, n, 8 * g, out_scales[j * oss], out_signs[j * osb + b]);
  }
}

// server_kernel<kServerUpdate> on groups [0, C/8) and commit_kernel on [0, P/8) in one grid: the
// same arithmetic per element (explicit _rn products keep the compiler from contracting the server
// sums into FMAs, as the CPU twin does not), so the same bits. kVecS: the server error is aligned.
template <int kType, bool kVec, bool kVecS>
__device__ __forceinline__ void commit_all_body(const uint8_t* __restrict__ signs, const float* scales,
                                                int64_t stride, float* serr, const float* tau_in, void* m,
                                                int64_t n, float* e, int64_t padded, const float* scale,
                                                const float* out_scales, int64_t oss, const uint8_t* out_signs,
                                                int64_t osb, int world, const float* guard,
                                                int64_t guard_stride, unsigned block, unsigned nblocks) {
  if (guard_trips(guard, guard_stride, world)) return;
  const float sigma = *scale, tau = *tau_in;
  const float inv_w = 1.0f / static_cast<float>(world);
  const int64_t groups = padded / 8, chunk_groups = groups / world;
  for (int64_t g = block * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(nblocks) * blockDim.x) {
    if (g < chunk_groups) {  // the server error of this rank's chunk
      float c[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int i = 0; i < world; ++i) {
        const float a = __fmul_rn(scales[i * stride], inv_w);
        const uint32_t byte = signs[i * chunk_groups + g];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = __fadd_rn(c[j], (byte >> (7 - j)) & 1u ? a : -a);
      }
      float s[8];
      load_f8<kVecS>(serr, 8 * g, s);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = __fadd_rn(c[j], s[j]);
        s[j] = __fsub_rn(c[j], __fmul_rn(tau, sgn(c[j])));
      }
      store_f8<kVecS>(serr, 8 * g, s);
    }
    const int64_t j = world == 1 ? 0 : g / chunk_groups, b = g - j * chunk_groups;
    float x[8], y[8];
    load_m8<kType, kVec>(m, n, 8 * g, x);
    load_f8<kVec>(e, 8 * g, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = __fadd_rn(x[i], y[i]);
      y[i] = __fsub_rn(x[i], __fmul_rn(sigma, sgn(x[i])));
    }
    store_f8<kVec>(e, 8 * g, y);
    store_out8<kType, kVec>(m, n, 8 * g, out_scales[j * oss], out_signs[j * osb + b]);
  }
}

template <int kType, bool kVec, bool kVecS>
__global__ void __launch_bounds__(kThreads)
    commit_all_kernel(const uint8_t* __restrict__ signs, const float* scales, int64_t stride, float* serr,
                      const float* tau_in, void* m, int64_t n, float* e, int64_t padded, const float* scale,
                      const float* out_scales, int64_t oss, const uint8_t* out_signs, int64_t osb, int world,
                      const float* guard, int64_t guard_stride) {
  commit_all_body<kType, kVec, kVecS>(signs, scales, stride, serr, tau_in, m, n, e, padded, scale, out_scales, oss,
                                      out_signs, osb, world, guard, guard_stride, blockIdx.x, gridDim.x);
}

__global__ void header_kernel(ExchangeHeader* h, int64_t numel, int64_t padded, int32_t dtype,
                              uint32_t magic) {
  h->flags = isfinite(h->scale) ? 0u : 1u;
  h->numel = numel;
  h->padded = padded;
  h->dtype = dtype;
  h->magic = magic;
}

// Calls f(Tag<type, vec>{}) for the input dtype; the launch status is returned.
template <class F>
Status dispatch(InputType dtype, bool vec, F&& f) {
  switch (dtype) {
    case InputType::kFloat32: vec ? f(Tag<kF32, true>{}) : f(Tag<kF32, false>{}); break;
    case InputType::kFloat16: vec ? f(Tag<kF16, true>{}) : f(Tag<kF16, false>{}); break;
    case InputType::kBFloat16: vec ? f(Tag<kBF16, true>{}) : f(Tag<kBF16, false>{}); break;
    default: return Status::kInvalidArgument;
  }
  return launched();
}

Status worker_launch(const void* m, InputType dtype, int64_t n, const float* e, int64_t padded,
                     float* scale, uint8_t* signs, void* ws, Stream stream, ExchangeHeader* header = nullptr,
                     int32_t header_dtype = 0, uint32_t magic = 0, HeaderNotice* notice = nullptr,
                     uint64_t seq = 0) {
  if (bad_sizes(n, padded)) return Status::kInvalidArgument;
  const int grid = grid_for(padded / 8, true);
  auto s = static_cast<cudaStream_t>(stream);
  return dispatch(dtype, aligned16(m) && aligned16(e), [&](auto tag) {
    using T = decltype(tag);
    worker_kernel<T::kType, T::kVec><<<grid, kThreads, 0, s>>>(m, n, e, padded, signs, scale, ws, header,
                                                              header_dtype, magic, notice, seq);
  });
}

template <int kMode>
Status server_launch(const uint8_t* signs, const float* scales, int64_t stride, int world, float* serr,
                     int64_t chunk, float* scale_out, uint8_t* packed, const float* tau_in,
                     const float* guard, int64_t guard_stride, void* ws, Stream stream) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  constexpr bool kReduce = (kMode & kServerScale) != 0;
  if (!kReduce && chunk == 0) return Status::kSuccess;
  const int grid = grid_for(chunk / 8, kReduce);
  auto s = static_cast<cudaStream_t>(stream);
  if (aligned16(serr))
    server_kernel<true, kMode><<<grid, kThreads, 0, s>>>(signs, scales, stride, world, serr, chunk, scale_out,
                                                        packed, tau_in, guard, guard_stride, ws);
  else
    server_kernel<false, kMode><<<grid, kThreads, 0, s>>>(signs, scales, stride, world, serr, chunk,
                                                         scale_out, packed, tau_in, guard, guard_stride, ws);
  return launched();
}

__global__ void decompress_kernel(const float* scale, const uint8_t* packed, int64_t count, float* out,
                                  const float* guard, int64_t guard_stride, int guard_count) {
  if (guard_trips(guard, guard_stride, guard_count)) return;
  const float t = *scale;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = (packed[i >> 3] >> (7 - (i & 7))) & 1 ? t : -t;
}

// One thread: the abort flag is read once (volatile: it may be mapped host memory that the NCCL
// watchdog sets), so every commit kernel after it sees the same verdict through its guard.
__global__ void commit_gate_kernel(const int* abort_flag, float* scales, int64_t stride, int world) {
  if (*static_cast<const volatile int*>(abort_flag) == 0) return;
  for (int i = 0; i < world; ++i) scales[i * stride] = __int_as_float(0x7fc00000);  // quiet NaN
}

}  // namespace

bool built() { return true; }

size_t scale_workspace_bytes(int64_t) { return kScratchBytes; }

Status worker_scale_pack(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                         float* scale, uint8_t* signs, void* workspace, Stream stream) {
  return worker_launch(m, dtype, n, error, padded, scale, signs, workspace, stream);
}

Status worker_scale_pack_header(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                                ExchangeHeader* header, int32_t header_dtype, uint32_t magic, uint8_t* signs,
                                void* workspace, Stream stream, HeaderNotice* notice, uint64_t seq) {
  if (header == nullptr) return Status::kInvalidArgument;
  return worker_launch(m, dtype, n, error, padded, &header->scale, signs, workspace, stream, header, header_dtype,
                       magic, notice, seq);
}

Status commit(const uint8_t* signs, const float* scales, int64_t scale_stride, float* server_error,
              const float* server_scale, void* m, InputType dtype, int64_t n, float* error, int64_t padded,
              const float* scale, const float* out_scales, int64_t out_scale_stride, const uint8_t* out_signs,
              int64_t out_sign_stride, int world, Stream stream, const float* guard, int64_t guard_stride) {
  if (bad_sizes(n, padded) || world < 1 || padded % (8 * world) != 0) return Status::kInvalidArgument;
  if (padded == 0) return Status::kSuccess;
  const int grid = grid_for(padded / 8, false);
  auto s = static_cast<cudaStream_t>(stream);
  const bool vec = aligned16(m) && aligned16(error);
  const bool vec_s = aligned16(server_error);
  return dispatch(dtype, vec, [&](auto tag) {
    using T = decltype(tag);
    auto* k = vec_s ? commit_all_kernel<T::kType, T::kVec, true> : commit_all_kernel<T::kType, T::kVec, false>;
    k<<<grid, kThreads, 0, s>>>(signs, scales, scale_stride, server_error, server_scale, m, n, error, padded, scale,
                                out_scales, out_scale_stride, out_signs, out_sign_stride, world, guard, guard_stride);
  });
}

Status server_scale_pack(const uint8_t* signs, const float* scales, int64_t stride, int world,
                         const float* server_error, int64_t chunk, float* scale, uint8_t* packed,
                         void* workspace, Stream stream) {
  return server_launch<kServerScale | kServerPack>(signs, scales, stride, world,
                                                   const_cast<float*>(server_error), chunk, scale, packed,
                                                   nullptr, nullptr, 0, workspace, stream);
}

Status server_update(const uint8_t* signs, const float* scales, int64_t stride, int world,
                     float* server_error, int64_t chunk, const float* scale, Stream stream,
                     const float* guard, int64_t guard_stride) {
  return server_launch<kServerUpdate>(signs, scales, stride, world, server_error, chunk, nullptr, nullptr,
                                      scale, guard, guard_stride, nullptr, stream);
}

Status worker_update_decompress(void* m, InputType dtype, int64_t n, float* error, int64_t padded,
                                const float* scale, const float* out_scales, int64_t out_scale_stride,
                                const uint8_t* out_signs, int64_t out_sign_stride, int world, Stream stream,
                                const float* guard, int64_t guard_stride) {
  if (bad_sizes(n, padded) || world < 1 || padded % (8 * world) != 0) return Status::kInvalidArgument;
  if (padded == 0) return Status::kSuccess;
  const int grid = grid_for(padded / 8, false);
  auto s = static_cast<cudaStream_t>(stream);
  return dispatch(dtype, aligned16(m) && aligned16(error), [&](auto tag) {
    using T = decltype(tag);
    commit_kernel<T::kType, T::kVec><<<grid, kThreads, 0, s>>>(m, n, error, padded, scale, out_scales,
                                                              out_scale_stride, out_signs, out_sign_stride,
                                                              world, guard, guard_stride);
  });
}

Status write_header(ExchangeHeader* header, int64_t numel, int64_t padded, int32_t dtype, uint32_t magic,
                    Stream stream) {
  header_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(header, numel, padded, dtype, magic);
  return launched();
}

Status decompress(const float* scale, const uint8_t* packed, int64_t count, float* out, Stream stream,
                  const float* guard, int64_t guard_stride, int guard_count) {
  if (count < 0 || (guard != nullptr && guard_count < 1)) return Status::kInvalidArgument;
  if (count == 0) return Status::kSuccess;
  const int grid = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 4096));
  decompress_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(scale, packed, count, out, guard,
                                                                               guard_stride, guard_count);
  return launched();
}

Status commit_gate(const int* abort_flag, float* scales, int64_t stride, int world, Stream stream) {
  if (abort_flag == nullptr || scales == nullptr || world < 0) return Status::kInvalidArgument;
  commit_gate_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(abort_flag, scales, stride, world);
  return launched();
}


// ---- batches (kernels.h): the jobs travel as kernel arguments, up to kPackBytes of them per launch;
// each job owns a contiguous range of the grid's blocks (first[j] .. first[j+1]), exactly the blocks
// its single launch would have had, so every bucket is computed as by its own launch. ----
namespace {

constexpr size_t kPackBytes = 3968;  // under the classic 4 KiB kernel-argument limit, with the others

template <class Job>
struct Pack {
  static constexpr int kMax = static_cast<int>((kPackBytes - 8) / (sizeof(Job) + sizeof(int32_t)) - 1);
  Job job[kMax];
  int32_t first[kMax + 1];  // job j runs blocks [first[j], first[j+1]); jobs of no block are skipped
  int32_t count;
};
static_assert(sizeof(Pack<CopyJob>) <= kPackBytes && sizeof(Pack<WorkerJob>) <= kPackBytes &&
                  sizeof(Pack<ServerJob>) <= kPackBytes && sizeof(Pack<CommitJob>) <= kPackBytes &&
                  sizeof(Pack<GateJob>) <= kPackBytes,
              "a pack must fit the kernel-argument limit");

// The job whose range holds `block`: the last j with first[j] <= block (a job of no block shares its
// first with the next one, which wins).
template <class Job>
__device__ __forceinline__ int job_of(const Pack<Job>& p, int block) {
  int lo = 0, hi = p.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.first[mid] <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Bytes [0, bytes) of s to d, in words of W where d and s are equally aligned: a head of bytes up to
// d's W-alignment, the words, a tail of bytes. Thread `start` of a grid-stride of `step`.
template <class W>
__device__ __forceinline__ void copy_words(const uint8_t* s, uint8_t* d, int64_t bytes, int64_t start,
                                           int64_t step) {
  constexpr int64_t kW = sizeof(W);
  const int64_t head = min(bytes, (kW - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) % kW)) % kW);
  for (int64_t i = start; i < head; i += step) d[i] = s[i];
  const int64_t words = (bytes - head) / kW;
  const W* sw = reinterpret_cast<const W*>(s + head);
  W* dw = reinterpret_cast<W*>(d + head);
  for (int64_t i = start; i < words; i += step) dw[i] = sw[i];
  for (int64_t i = head + words * kW + start; i < bytes; i += step) d[i] = s[i];
}

// The widest word that src and dst share an alignment for (16 bytes when they are equally aligned
// mod 16; a copy between buffers misaligned to each other goes in narrower words, down to bytes).
__global__ void __launch_bounds__(kThreads) batch_copy_kernel(const __grid_constant__ Pack<CopyJob> p) {
  const int j = job_of(p, blockIdx.x);
  const CopyJob& c = p.job[j];
  const unsigned block = blockIdx.x - p.first[j], nblocks = p.first[j + 1] - p.first[j];
  const int64_t start = block * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(nblocks) * blockDim.x;
  const auto* s = static_cast<const uint8_t*>(c.src);
  auto* d = static_cast<uint8_t*>(c.dst);
  const uintptr_t x = reinterpret_cast<uintptr_t>(s) ^ reinterpret_cast<uintptr_t>(d);
  if ((x & 15u) == 0)
    copy_words<uint4>(s, d, c.bytes, start, step);
  else if ((x & 7u) == 0)
    copy_words<uint2>(s, d, c.bytes, start, step);
  else if ((x & 3u) == 0)
    copy_words<uint32_t>(s, d, c.bytes, start, step);
  else if ((x & 1u) == 0)
    copy_words<uint16_t>(s, d, c.bytes, start, step);
  else
    copy_words<uint8_t>(s, d, c.bytes, start, step);
}

template <int kType, bool kVec>
__global__ void __launch_bounds__(kThreads)
    worker_many_kernel(const __grid_constant__ Pack<WorkerJob> p, uint32_t magic) {
  const int j = job_of(p, blockIdx.x);
  const WorkerJob& w = p.job[j];
  worker_body<kType, kVec>(w.m, w.n, w.error, w.padded, w.signs, &w.header->scale, w.workspace, w.header,
                           w.header_dtype, magic, nullptr, 0, blockIdx.x - p.first[j], p.first[j + 1] - p.first[j]);
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) server_many_kernel(const __grid_constant__ Pack<ServerJob> p, int world) {
  const int j = job_of(p, blockIdx.x);
  const ServerJob& v = p.job[j];
  server_body<kVec, kServerScale | kServerPack>(v.signs, v.scales, v.scale_stride, world,
                                                const_cast<float*>(v.server_error), v.chunk, v.scale, v.packed,
                                                nullptr, nullptr, 0, v.workspace, blockIdx.x - p.first[j],
                                                p.first[j + 1] - p.first[j]);
}

template <int kType, bool kVec, bool kVecS>
__global__ void __launch_bounds__(kThreads) commit_many_kernel(const __grid_constant__ Pack<CommitJob> p, int world) {
  const int j = job_of(p, blockIdx.x);
  const CommitJob& c = p.job[j];
  commit_all_body<kType, kVec, kVecS>(c.signs, c.scales, c.scale_stride, c.server_error, c.server_scale, c.m, c.n,
                                      c.error, c.padded, c.scale, c.out_scales, c.out_scale_stride, c.out_signs,
                                      c.out_sign_stride, world, c.guard, c.guard_stride, blockIdx.x - p.first[j],
                                      p.first[j + 1] - p.first[j]);
}

// One thread, as commit_gate_kernel: the flag is read once for every job of the batch. The first pack
// reads it (decided == nullptr); later packs read the first pack's verdict instead (its first job's
// scale 0, NaN once gated: a committed scale is never NaN), so a flag raised between two launches
// cannot gate half a batch.
__global__ void commit_gate_many_kernel(const int* abort_flag, const float* decided,
                                        const __grid_constant__ Pack<GateJob> p, int world) {
  const bool abort = decided == nullptr ? *static_cast<const volatile int*>(abort_flag) != 0
                                        : isnan(*static_cast<const volatile float*>(decided));
  if (!abort) return;
  for (int j = 0; j < p.count; ++j)
    for (int i = 0; i < world; ++i) p.job[j].scales[i * p.job[j].stride] = __int_as_float(0x7fc00000);
}

// Launches `launch(pack, blocks)` for the jobs in `idx` (indices into `jobs`), kMax at a time; job i
// gets blocks_of(jobs[i]) blocks (0: skipped).
template <class Job, class BlocksOf, class Launch>
Status launch_packs(const Job* jobs, const std::vector<int64_t>& idx, BlocksOf blocks_of, Launch launch) {
  Pack<Job> p;
  size_t i = 0;
  while (i < idx.size()) {
    p.count = 0;
    int32_t total = 0;
    for (; i < idx.size() && p.count < Pack<Job>::kMax; ++i) {
      p.job[p.count] = jobs[idx[i]];
      p.first[p.count++] = total;
      total += blocks_of(jobs[idx[i]]);
    }
    p.first[p.count] = total;
    if (total == 0) continue;
    launch(p, total);
    if (launched() != Status::kSuccess) return Status::kCudaError;
  }
  return Status::kSuccess;
}

// The jobs' indices grouped by a kernel variant key in [0, kinds) (dtype and alignment flags), so
// each group is one kernel instantiation.
template <class Job, class KeyOf>
std::vector<std::vector<int64_t>> group_by(const Job* jobs, int64_t count, int kinds, KeyOf key_of) {
  std::vector<std::vector<int64_t>> g(static_cast<size_t>(kinds));
  for (int64_t i = 0; i < count; ++i) g[static_cast<size_t>(key_of(jobs[i]))].push_back(i);
  return g;
}

int type_code(InputType t) { return t == InputType::kFloat16 ? kF16 : t == InputType::kBFloat16 ? kBF16 : kF32; }

// Calls f(Tag<type, vec>{}) for a type code (as dispatch, without the launch check).
template <class F>
void for_type(int type, bool vec, F&& f) {
  if (type == kF16) vec ? f(Tag<kF16, true>{}) : f(Tag<kF16, false>{});
  else if (type == kBF16) vec ? f(Tag<kBF16, true>{}) : f(Tag<kBF16, false>{});
  else vec ? f(Tag<kF32, true>{}) : f(Tag<kF32, false>{});
}

}  // namespace

Status batch_copy(const CopyJob* jobs, int64_t count, Stream stream) {
  if (batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < count; ++i)
    if (jobs[i].bytes > 0 && jobs[i].src != jobs[i].dst) idx.push_back(i);
  auto s = static_cast<cudaStream_t>(stream);
  // A block moves 4 KiB per pass in 16-byte words; at most 512 blocks per copy (a one-bucket step's
  // signs are megabytes per peer, in narrower words where the two sides are misaligned to each other).
  return launch_packs(
      jobs, idx, [](const CopyJob& c) { return static_cast<int32_t>(std::min<int64_t>((c.bytes + 4095) / 4096, 512)); },
      [&](const Pack<CopyJob>& p, int32_t blocks) { batch_copy_kernel<<<blocks, kThreads, 0, s>>>(p); });
}

Status worker_scale_pack_header_many(const WorkerJob* jobs, int64_t count, uint32_t magic, Stream stream) {
  if (batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  auto s = static_cast<cudaStream_t>(stream);
  const auto groups = group_by(jobs, count, 6, [](const WorkerJob& w) {
    return 2 * type_code(w.dtype) + (aligned16(w.m) && aligned16(w.error));
  });
  for (int key = 0; key < 6; ++key) {
    Status st = Status::kSuccess;
    for_type(key / 2, key % 2, [&](auto tag) {
      using T = decltype(tag);
      st = launch_packs(
          jobs, groups[key], [](const WorkerJob& w) { return grid_for(w.padded / 8, true); },
          [&](const Pack<WorkerJob>& p, int32_t blocks) {
            worker_many_kernel<T::kType, T::kVec><<<blocks, kThreads, 0, s>>>(p, magic);
          });
    });
    if (st != Status::kSuccess) return st;
  }
  return Status::kSuccess;
}

Status server_scale_pack_many(const ServerJob* jobs, int64_t count, int world, Stream stream) {
  if (batch::any_bad(jobs, count, world)) return Status::kInvalidArgument;
  auto s = static_cast<cudaStream_t>(stream);
  const auto groups = group_by(jobs, count, 2, [](const ServerJob& v) { return aligned16(v.server_error) ? 1 : 0; });
  auto blocks = [](const ServerJob& v) { return grid_for(v.chunk / 8, true); };
  Status st = launch_packs(jobs, groups[0], blocks, [&](const Pack<ServerJob>& p, int32_t b) {
    server_many_kernel<false><<<b, kThreads, 0, s>>>(p, world);
  });
  if (st != Status::kSuccess) return st;
  return launch_packs(jobs, groups[1], blocks, [&](const Pack<ServerJob>& p, int32_t b) {
    server_many_kernel<true><<<b, kThreads, 0, s>>>(p, world);
  });
}

Status commit_many(const CommitJob* jobs, int64_t count, int world, Stream stream) {
  if (batch::any_bad(jobs, count, world)) return Status::kInvalidArgument;
  auto s = static_cast<cudaStream_t>(stream);
  const auto groups = group_by(jobs, count, 12, [](const CommitJob& c) {
    return 4 * type_code(c.dtype) + 2 * (aligned16(c.m) && aligned16(c.error)) + aligned16(c.server_error);
  });
  // as commit(): nothing to do (no launch) for an empty bucket
  auto blocks = [](const CommitJob& c) { return c.padded == 0 ? 0 : grid_for(c.padded / 8, false); };
  for (int key = 0; key < 12; ++key) {
    Status st = Status::kSuccess;
    const bool vec_s = key % 2;
    for_type(key / 4, (key / 2) % 2, [&](auto tag) {
      using T = decltype(tag);
      st = launch_packs(jobs, groups[key], blocks, [&](const Pack<CommitJob>& p, int32_t b) {
        if (vec_s)
          commit_many_kernel<T::kType, T::kVec, true><<<b, kThreads, 0, s>>>(p, world);
        else
          commit_many_kernel<T::kType, T::kVec, false><<<b, kThreads, 0, s>>>(p, world);
      });
    });
    if (st != Status::kSuccess) return st;
  }
  return Status::kSuccess;
}

Status commit_gate_many(const int* abort_flag, const GateJob* jobs, int64_t count, int world, Stream stream) {
  if (abort_flag == nullptr || world < 0 || batch::any_bad(jobs, count)) return Status::kInvalidArgument;
  if (count == 0) return Status::kSuccess;
  // One thread reads the flag once for the whole batch; a batch longer than a pack is gated in
  // several launches (in stream order, before every commit), the later ones following the first's
  // verdict.
  auto s = static_cast<cudaStream_t>(stream);
  std::vector<int64_t> idx(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) idx[static_cast<size_t>(i)] = i;
  const float* decided = nullptr;
  return launch_packs(jobs, idx, [](const GateJob&) { return 1; }, [&](const Pack<GateJob>& p, int32_t) {
    commit_gate_many_kernel<<<1, 1, 0, s>>>(abort_flag, decided, p, world);
    if (decided == nullptr && world > 0) decided = p.job[0].scales;
  });
}

}  // namespace cuda

Status device_copy(void* dst, const void* src, int64_t bytes, Stream stream) {
  if (bytes <= 0 || dst == src) return Status::kSuccess;
  const cudaError_t err = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault,
                                          static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? Status::kSuccess : Status::kCudaError;
}

ScopedDevice::ScopedDevice(int device) {
  int current = -1;
  if (device < 0 || cudaGetDevice(&current) != cudaSuccess || current == device) return;
  if (cudaSetDevice(device) == cudaSuccess) prev_ = current;
}

ScopedDevice::~ScopedDevice() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

Status device_fill(void* dst, int value, int64_t bytes, Stream stream) {
  if (bytes <= 0) return Status::kSuccess;
  return cudaMemsetAsync(dst, value, static_cast<size_t>(bytes), static_cast<cudaStream_t>(stream)) == cudaSuccess
             ? Status::kSuccess
             : Status::kCudaError;
}

Status host_alloc(void** ptr, int64_t bytes) {
  if (ptr == nullptr || bytes <= 0) return Status::kInvalidArgument;
  if (cudaHostAlloc(ptr, static_cast<size_t>(bytes), cudaHostAllocPortable) == cudaSuccess) return Status::kSuccess;
  cudaGetLastError();  // clear it, so the next launch does not report this failure as its own
  *ptr = nullptr;
  return Status::kCudaError;
}

void host_free(void* ptr) {
  if (ptr != nullptr && cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();
}

Status host_alloc_mapped(void** host_ptr, void** device_ptr, int64_t bytes) {
  if (host_ptr == nullptr || device_ptr == nullptr || bytes <= 0) return Status::kInvalidArgument;
  *host_ptr = *device_ptr = nullptr;
  void* h = nullptr;
  if (cudaHostAlloc(&h, static_cast<size_t>(bytes), cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess) {
    if (cudaHostGetDevicePointer(device_ptr, h, 0) == cudaSuccess) {
      *host_ptr = h;
      return Status::kSuccess;
    }
    cudaFreeHost(h);
  }
  cudaGetLastError();  // not sticky: clear it, as host_alloc does
  *device_ptr = nullptr;
  return Status::kCudaError;
}

Status stream_idle(Stream stream, bool* idle) {
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  *idle = err == cudaSuccess;
  if (err == cudaSuccess || err == cudaErrorNotReady) {
    if (err == cudaErrorNotReady) cudaGetLastError();  // not an error: do not leave it for the next launch
    return Status::kSuccess;
  }
  return Status::kCudaError;
}

Status stream_capturing(Stream stream, bool* capturing) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) return Status::kCudaError;
  *capturing = st != cudaStreamCaptureStatusNone;
  return Status::kSuccess;
}

Status stream_sync(Stream stream) {
  return cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) == cudaSuccess ? Status::kSuccess
                                                                                 : Status::kCudaError;
}

}  // namespace compcomm::kernels
