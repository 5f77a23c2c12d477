// Multi-tensor CUDA twins of 1-bit LAMB's CPU passes (cpu_lamb.h is the contract; optim_kernels.h
// declares them). Per element the same fp32 operations in the same order as the CPU passes: this
// file is compiled with -fmad=false, the fused multiply-adds are the explicit __fmaf_rn of the CPU's
// fma, and divisions and square roots are IEEE-rounded (nvcc's -prec-div/-prec-sqrt defaults; the
// GPU's sqrt is the CPU passes' 'ieee' mode), so a tensor's new m, v_fresh and w are the CPU passes'
// bits. The statistics' fp64 sums run in another order than the CPU's (per 64K-element chunk a block
// reduces in a fixed tree, then the chunks in order): deterministic, but not the CPU's last bits.
//
// Layout as cuda_optim.cu: the host cuts the tensors into kChunk-element chunks and packs up to kT
// tensors and kMaxBlocks (tensor, chunk) pairs per launch into a struct passed by value; a tensor
// that does not fit continues as slot 0 of the next launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cpu_lamb.h"
#include "optim_kernels.h"

namespace compcomm::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kIlp = 4;  // elements a thread loads before computing (loads in flight)
constexpr int64_t kChunk = 65536;
constexpr int kMaxBlocks = 320;
// The statistics pass holds kIlp elements of five lists and fp64 sums: at its natural 94 registers
// only 2 blocks fit an SM, so a launch's 320 blocks took two waves on 132 SMs, the second a sixth
// full. Capped at 80 registers, 3 blocks fit and a launch is one wave again.
constexpr int kStatsBlocksPerSm = 3;
constexpr int kT = 32;

struct Launch {
  void* p[5][kT];       // the pass's lists (see each kernel)
  int64_t numel[kT];
  float scalar[kT];     // the per-tensor scale (momentum, stats) or step (apply)
  int64_t part0[kT];    // the tensor's first partial (stats, finish)
  int32_t index[kT];    // the tensor's index in the call (finish)
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(Launch) + sizeof(cpu::LambCoeffs) <= 4000, "kernel arguments over 4 KiB");

__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// The direction from the unscaled momentum, sqrt(v) and w: u (out) and u + w * wd (returned).
__device__ __forceinline__ float direction(const cpu::LambCoeffs& c, float m, float s, float w,
                                           float* u_out) {
  float u;
  if (c.bias_correction) {
    u = m / ((c.bc2 != 1.f ? s / c.bc2 : s) + c.eps);
    if (c.bc1 != 1.f) u = u / c.bc1;
  } else {
    u = m / (s + c.eps);
  }
  *u_out = u;
  return c.weight_decay ? u + w * c.wd : u;
}

struct Range {
  int t;
  int64_t begin, end;
};

__device__ __forceinline__ Range range_of(const Launch& L) {
  const int t = L.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(L.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = L.numel[t] < begin + kChunk ? L.numel[t] : begin + kChunk;
  return {t, begin, end};
}

// 0 m, 1 g, 2 last: last = m; m = fma(g, c1, m * b1) [* scale].
__global__ void __launch_bounds__(kThreads) momentum_kernel(const Launch L, const cpu::LambCoeffs c) {
  const Range r = range_of(L);
  float* m = static_cast<float*>(L.p[0][r.t]);
  const float* g = static_cast<const float*>(L.p[1][r.t]);
  float* last = static_cast<float*>(L.p[2][r.t]);
  const float sc = L.scalar[r.t];
  for (int64_t base = r.begin + threadIdx.x; base < r.end; base += kIlp * blockDim.x) {
    float x[kIlp], y[kIlp];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i < r.end) x[j] = m[i], y[j] = g[i];
    }
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i >= r.end) continue;
      last[i] = x[j];
      const float z = __fmaf_rn(y[j], c.c1, x[j] * c.b1);
      m[i] = sc != 1.f ? z * sc : z;
    }
  }
}

// 0 m, 1 last (or g: local), 2 v, 3 v_fresh, 4 w: the statistics pass; one partial per block.
__global__ void __launch_bounds__(kThreads, kStatsBlocksPerSm) stats_kernel(const Launch L, const cpu::LambCoeffs c,
                                                          bool local, double* partials,
                                                          const uint8_t* gate) {
  if (gate != nullptr && *gate == 0) return;  // optim_kernels.h: nothing written
  const Range r = range_of(L);
  float* m = static_cast<float*>(L.p[0][r.t]);
  const float* aux = static_cast<const float*>(L.p[1][r.t]);
  const float* v = static_cast<const float*>(L.p[2][r.t]);
  float* vf = static_cast<float*>(L.p[3][r.t]);
  const float* w = static_cast<const float*>(L.p[4][r.t]);
  const float sc = L.scalar[r.t];
  float mx = -__int_as_float(0x7f800000);
  double su = 0.0, sd = 0.0;
  // kIlp elements a thread and iteration, every load issued before the arithmetic (the stores to
  // m and v_fresh would otherwise keep the compiler from hoisting the next loads)
  for (int64_t base = r.begin + threadIdx.x; base < r.end; base += kIlp * blockDim.x) {
    float xm[kIlp], xa[kIlp], xv[kIlp], xf[kIlp], xw[kIlp];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i < r.end) xm[j] = m[i], xa[j] = aux[i], xv[j] = v[i], xf[j] = vf[i], xw[j] = w[i];
    }
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i >= r.end) continue;
      float mv = xm[j], lv;
      if (local) {
        lv = mv;
        mv = __fmaf_rn(xa[j], c.c1, mv * c.b1);
        if (sc != 1.f) mv = (mv * sc) / sc;
        m[i] = mv;
      } else {
        lv = xa[j];
        if (sc != 1.f) {
          mv = mv / sc;
          m[i] = mv;
        }
      }
      const float gh = (mv - lv * c.b1) / c.c1;
      const float f = __fmaf_rn(c.c2 * gh, gh, xf[j] * c.b2);
      vf[i] = f;
      const float s = c.v_is_sqrt ? xv[j] : sqrtf(xv[j]);
      mx = max_nan((s + c.eps) / (sqrtf(f) + c.eps), mx);
      float u;
      const float d = direction(c, mv, s, xw[j], &u);
      su += static_cast<double>(u) * static_cast<double>(u);
      sd += static_cast<double>(d) * static_cast<double>(d);
    }
  }
  __shared__ float smx[kThreads];
  __shared__ double ssu[kThreads], ssd[kThreads];
  smx[threadIdx.x] = mx, ssu[threadIdx.x] = su, ssd[threadIdx.x] = sd;
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k /= 2) {  // a fixed tree: the same sums every run
    if (threadIdx.x < k) {
      smx[threadIdx.x] = max_nan(smx[threadIdx.x + k], smx[threadIdx.x]);
      ssu[threadIdx.x] += ssu[threadIdx.x + k];
      ssd[threadIdx.x] += ssd[threadIdx.x + k];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double* out = partials + 3 * (L.part0[r.t] + L.block_chunk[blockIdx.x]);
    out[0] = smx[0], out[1] = ssu[0], out[2] = ssd[0];
  }
}

// One warp per tensor (block): lane l sums the partials of chunks l, l+32, ..., then a fixed
// shuffle tree (the same sums every run) -> (max ratio, ||u||, ||update||) in fp32. (One thread a
// tensor read the embedding's ~540 partials one after the other: ~90 us a step.)
__global__ void finish_kernel(const Launch L, bool weight_decay, const double* partials, float* out) {
  const int t = blockIdx.x;
  const int64_t chunks = (L.numel[t] + kChunk - 1) / kChunk;
  float mx = -__int_as_float(0x7f800000);
  double su = 0.0, sd = 0.0;
  for (int64_t k = threadIdx.x; k < chunks; k += 32) {
    const double* p = partials + 3 * (L.part0[t] + k);
    mx = max_nan(static_cast<float>(p[0]), mx);
    su += p[1];
    sd += p[2];
  }
  for (int d = 16; d > 0; d /= 2) {
    mx = max_nan(__shfl_down_sync(0xffffffffu, mx, d), mx);
    su += __shfl_down_sync(0xffffffffu, su, d);
    sd += __shfl_down_sync(0xffffffffu, sd, d);
  }
  if (threadIdx.x != 0) return;
  float* o = out + 3 * L.index[t];
  o[0] = mx, o[1] = static_cast<float>(sqrt(su)), o[2] = static_cast<float>(sqrt(weight_decay ? sd : su));
}

// 0 m, 1 v, 2 w: w = w + update * step.
__global__ void __launch_bounds__(kThreads) apply_kernel(const Launch L, const cpu::LambCoeffs c) {
  const Range r = range_of(L);
  const float* m = static_cast<const float*>(L.p[0][r.t]);
  const float* v = static_cast<const float*>(L.p[1][r.t]);
  float* w = static_cast<float*>(L.p[2][r.t]);
  const float step = L.scalar[r.t];
  for (int64_t base = r.begin + threadIdx.x; base < r.end; base += kIlp * blockDim.x) {
    float xm[kIlp], xv[kIlp], xw[kIlp];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i < r.end) xm[j] = m[i], xv[j] = v[i], xw[j] = w[i];
    }
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i >= r.end) continue;
      const float s = c.v_is_sqrt ? xv[j] : sqrtf(xv[j]);
      float u;
      w[i] = xw[j] + direction(c, xm[j], s, xw[j], &u) * step;
    }
  }
}

// The chunked launches of one pass: lists[d][i] is list d's pointer for tensor i (depth lists, all
// required where numels[i] > 0); scalars may be nullptr.
template <class F>
Status launch_chunks(int count, const int64_t* numels, int depth, const void* const* const* lists,
                     const float* scalars, const F& launch) {
  if (count < 0 || (count > 0 && numels == nullptr)) return Status::kInvalidArgument;
  for (int i = 0; i < count; ++i) {
    if (numels[i] < 0) return Status::kInvalidArgument;
    for (int d = 0; d < depth && numels[i] > 0; ++d)
      if (lists[d][i] == nullptr) return Status::kInvalidArgument;
  }
  Launch l;
  std::memset(&l, 0, sizeof(l));
  int nt = 0, nb = 0;
  int64_t part = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = numels[i];
    if (n == 0) continue;
    for (int d = 0; d < depth; ++d) l.p[d][nt] = const_cast<void*>(lists[d][i]);
    l.numel[nt] = n;
    l.scalar[nt] = scalars != nullptr ? scalars[i] : 1.f;
    l.part0[nt] = part;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    part += chunks;
    ++nt;
    for (int64_t k = 0; k < chunks; ++k) {
      l.block_tensor[nb] = static_cast<uint8_t>(nt - 1);
      l.block_chunk[nb] = static_cast<int32_t>(k);
      ++nb;
      const bool last = k == chunks - 1;
      if (nb == kMaxBlocks || (nt == kT && last)) {
        if (!launch(l, nb)) return Status::kCudaError;
        nb = 0;
        if (last) {
          nt = 0;
        } else {  // the tensor goes on in the next launch, as its slot 0
          for (int d = 0; d < depth; ++d) l.p[d][0] = l.p[d][nt - 1];
          l.numel[0] = l.numel[nt - 1];
          l.scalar[0] = l.scalar[nt - 1];
          l.part0[0] = l.part0[nt - 1];
          nt = 1;
        }
      }
    }
  }
  if (nb > 0 && !launch(l, nb)) return Status::kCudaError;
  return Status::kSuccess;
}

bool launched() { return cudaGetLastError() == cudaSuccess; }

}  // namespace

int64_t lamb_partials(int count, const int64_t* numels) {
  int64_t part = 0;
  for (int i = 0; i < count; ++i) part += numels[i] > 0 ? (numels[i] + kChunk - 1) / kChunk : 0;
  return part;
}

Status lamb_momentum(const cpu::LambCoeffs& c, int count, const int64_t* numels, float* const* m,
                     const float* const* g, float* const* last, const float* scales, Stream stream) {
  const void* const* lists[] = {reinterpret_cast<const void* const*>(m),
                                reinterpret_cast<const void* const*>(g),
                                reinterpret_cast<const void* const*>(last)};
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_chunks(count, numels, 3, lists, scales, [&](const Launch& l, int blocks) {
    momentum_kernel<<<blocks, kThreads, 0, s>>>(l, c);
    return launched();
  });
}

Status lamb_stats(const cpu::LambCoeffs& c, int count, const int64_t* numels, float* const* m,
                  const float* const* last, const float* const* g, const float* const* v,
                  float* const* vf, const float* const* w, const float* scales, double* partials,
                  float* out, const uint8_t* gate, Stream stream) {
  const bool local = g != nullptr;
  if (partials == nullptr || out == nullptr || (local == (last != nullptr)))
    return Status::kInvalidArgument;
  const void* const* lists[] = {reinterpret_cast<const void* const*>(m),
                                reinterpret_cast<const void* const*>(local ? g : last),
                                reinterpret_cast<const void* const*>(v),
                                reinterpret_cast<const void* const*>(vf),
                                reinterpret_cast<const void* const*>(w)};
  const auto s = static_cast<cudaStream_t>(stream);
  const Status st = launch_chunks(count, numels, 5, lists, scales, [&](const Launch& l, int blocks) {
    stats_kernel<<<blocks, kThreads, 0, s>>>(l, c, local, partials, gate);
    return launched();
  });
  if (st != Status::kSuccess) return st;
  // the per-tensor totals, kT tensors a launch (an empty tensor: no partials, max -inf, norms 0)
  Launch l;
  std::memset(&l, 0, sizeof(l));
  int64_t part = 0;
  for (int i0 = 0; i0 < count; i0 += kT) {
    const int k = count - i0 < kT ? count - i0 : kT;
    for (int j = 0; j < k; ++j) {
      l.numel[j] = numels[i0 + j];
      l.part0[j] = part;
      l.index[j] = i0 + j;
      part += (numels[i0 + j] + kChunk - 1) / kChunk;
    }
    finish_kernel<<<k, 32, 0, s>>>(l, c.weight_decay, partials, out);
    if (!launched()) return Status::kCudaError;
  }
  return Status::kSuccess;
}

Status lamb_apply(const cpu::LambCoeffs& c, int count, const int64_t* numels, const float* const* m,
                  const float* const* v, float* const* w, const float* steps, Stream stream) {
  if (steps == nullptr && count > 0) return Status::kInvalidArgument;
  const void* const* lists[] = {reinterpret_cast<const void* const*>(m),
                                reinterpret_cast<const void* const*>(v),
                                reinterpret_cast<const void* const*>(w)};
  const auto s = static_cast<cudaStream_t>(stream);
  return launch_chunks(count, numels, 3, lists, steps, [&](const Launch& l, int blocks) {
    apply_kernel<<<blocks, kThreads, 0, s>>>(l, c);
    return launched();
  });
}

}  // namespace compcomm::kernels::cuda
