// Multi-tensor CUDA kernels of the 1-bit Adam update (optim_kernels.h is the contract).
//
// How the work is laid out (the multi-tensor apply of apex and torch's foreach kernels): the host cuts
// every tensor of the lists into chunks of kChunk elements and packs up to kMaxTensors tensors (their
// pointers, sizes and low-precision types) and up to kMaxBlocks (tensor, chunk) pairs into a struct
// passed BY VALUE as the kernel's argument; block b does chunk block_chunk[b] of tensor
// block_tensor[b]. A tensor whose chunks do not fit one launch continues as slot 0 of the next. So a
// list of ~150 tensors of 121M elements in all is about six launches, each one pass over its memory.
// Inside a block each thread handles kIlp elements per iteration: one 16-byte load per fp32 list
// (8 bytes for the low-precision output) when every pointer of the tensor is aligned for it, strided
// scalar loads otherwise (views at odd offsets); a tensor's last < kIlp elements are done one by one.
//
// Numerics: this file is compiled with -fmad=false (cpp/kernels/CMakeLists.txt), divisions and
// square roots are IEEE-rounded (nvcc's default -prec-div=true -prec-sqrt=true), so every operation
// is one fp32 rounding in the order functional.py does it, and a float32 CPU evaluation of that
// order gives the same bits. The scalars are rounded to fp32 as torch rounds a python-float argument.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "optim_kernels.h"

namespace compcomm::kernels {
namespace cuda {
namespace {

// 256 threads: with the warm-up step's 64 registers 4 blocks fit an SM, so a launch's 320 blocks are
// one wave on an H200 (132 SMs); the blocks of 512 that torch's foreach kernels use would need two.
constexpr int kThreads = 256;
constexpr int kIlp = 4;
constexpr int64_t kChunk = 65536;
constexpr int kMaxBlocks = 320;
constexpr size_t kMaxParamBytes = 4000;  // kernel parameters are limited to 4 KiB

// One launch's tensors: kDepth pointer lists (the last may be a low-precision output).
template <int kDepth, int kMaxTensors>
struct Lists {
  void* ptr[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  uint8_t lowp_type[kMaxTensors];  // InputType of the low-precision output (0: none)
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

// The hyper-parameters rounded to fp32 (torch rounds a python float argument to the tensor's dtype).
struct Scalars {
  float neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bc1, sqrt_bc2;
  bool bias_correction, decay;
};

Scalars scalars_of(const AdamHyper& h) {
  Scalars s;
  s.neg_lr = static_cast<float>(-h.lr);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.bc1 = static_cast<float>(h.bc1);
  s.sqrt_bc2 = static_cast<float>(h.sqrt_bc2);
  s.bias_correction = h.bias_correction;
  s.decay = h.weight_decay > 0;
  return s;
}

// functional.adam_denom / adam_update / adam_step_: the new w.
__device__ __forceinline__ float adam_step(float m, float v, float w, const Scalars& s) {
  float denom = sqrtf(v);
  if (s.bias_correction) denom = denom / s.sqrt_bc2;
  denom = denom + s.eps;
  float u = m / denom;
  if (s.bias_correction) u = u / s.bc1;
  if (s.decay) u = u + s.weight_decay * w;
  return w + s.neg_lr * u;
}

// Each op names its lists (slots), which it reads (kLoad bits) and writes (kStore bits), whether a
// slot may be nullptr (kOptional: read as 0), and which slot's value goes to the low-precision
// output (kLowpFrom, -1: no such output; else the output is the extra slot kDepth).

// 0 out, 1 m, 2 g.
struct MomentumOp {
  static constexpr int kDepth = 3, kLoad = 0b110, kStore = 0b001, kOptional = 0b010, kLowpFrom = -1;
  float beta1, one_minus_beta1;
  __device__ __forceinline__ void operator()(float (&x)[kDepth]) const {
    x[0] = x[1] * beta1 + one_minus_beta1 * x[2];
  }
};

// 0 x (read only): clears *flag where an element is Inf or NaN (every writer writes 0: no race
// that matters). The finiteness gate of the steps above, one read of 4 bytes per element.
struct FiniteOp {
  static constexpr int kDepth = 1, kLoad = 0b1, kStore = 0, kOptional = 0, kLowpFrom = -1;
  uint8_t* flag;
  __device__ __forceinline__ void operator()(float (&x)[kDepth]) const {
    if (!isfinite(x[0])) *flag = 0;
  }
};

// 0 a, 1 m, 2 v, 3 w (+ 4 low-precision w).
struct CompressedStepOp {
  static constexpr int kDepth = 4, kLoad = 0b1101, kStore = 0b1010, kOptional = 0, kLowpFrom = 3;
  Scalars s;
  __device__ __forceinline__ void operator()(float (&x)[kDepth]) const {
    x[1] = x[0];
    x[3] = adam_step(x[0], x[2], x[3], s);
  }
};

// 0 m, 1 v, 2 g, 3 w (+ 4 low-precision w): the compressed phase with nothing to exchange (one
// rank), MomentumOp's momentum then CompressedStepOp's step in registers (v only read).
struct LocalStepOp {
  static constexpr int kDepth = 4, kLoad = 0b1111, kStore = 0b1001, kOptional = 0, kLowpFrom = 3;
  Scalars s;
  __device__ __forceinline__ void operator()(float (&x)[kDepth]) const {
    x[0] = x[0] * s.beta1 + s.one_minus_beta1 * x[2];
    x[3] = adam_step(x[0], x[1], x[3], s);
  }
};

// 0 m, 1 v, 2 g, 3 w (+ 4 low-precision w).
struct WarmupStepOp {
  static constexpr int kDepth = 4, kLoad = 0b1111, kStore = 0b1011, kOptional = 0, kLowpFrom = 3;
  Scalars s;
  __device__ __forceinline__ void operator()(float (&x)[kDepth]) const {
    const float g = x[2];
    const float m = x[0] * s.beta1 + s.one_minus_beta1 * g;
    const float v = x[1] * s.beta2 + (s.one_minus_beta2 * g) * g;
    x[0] = m;
    x[1] = v;
    x[3] = adam_step(m, v, x[3], s);
  }
};

template <class Op>
constexpr int slots() {
  return Op::kDepth + (Op::kLowpFrom >= 0 ? 1 : 0);
}

__device__ __forceinline__ uint32_t lowp_bits(float f, int type) {
  if (type == static_cast<int>(InputType::kBFloat16)) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  return __half_as_ushort(__float2half_rn(f));
}

// gate (nullptr: none): a device byte written by earlier work on the stream; 0 makes the launch a
// no-op (the gradients' finiteness verdict, so the host need not wait for it before launching).
template <class Op, class L>
__global__ void __launch_bounds__(kThreads)
    multi_tensor_kernel(const L lists, const Op op, const uint8_t* gate) {
  if (gate != nullptr && *gate == 0) return;
  constexpr int D = Op::kDepth;
  const int t = lists.block_tensor[blockIdx.x];
  const int64_t n = lists.numel[t];
  const int64_t begin = static_cast<int64_t>(lists.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = n < begin + kChunk ? n : begin + kChunk;
  // 16-byte loads a thread issues per iteration and list: a read-only op (the finiteness check, one
  // list) needs four in flight to keep HBM busy; the others load several lists already
  constexpr int kUnroll = Op::kStore == 0 && Op::kLowpFrom < 0 ? 4 : 1;
  float* p[D];
  bool vec = true;
#pragma unroll
  for (int d = 0; d < D; ++d) {
    p[d] = static_cast<float*>(lists.ptr[d][t]);
    vec = vec && (reinterpret_cast<uintptr_t>(p[d]) & 15u) == 0;  // nullptr counts as aligned
  }
  uint16_t* lp = nullptr;
  int lt = 0;
  if constexpr (Op::kLowpFrom >= 0) {
    lp = static_cast<uint16_t*>(lists.ptr[D][t]);
    lt = lists.lowp_type[t];
    vec = vec && (reinterpret_cast<uintptr_t>(lp) & 7u) == 0;
  }
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kIlp;
  int64_t scalar_from = begin;
  if (vec) {
    const int64_t vend = begin + ((end - begin) & ~static_cast<int64_t>(kIlp - 1));
    for (int64_t i0 = begin + static_cast<int64_t>(threadIdx.x) * kIlp; i0 < vend; i0 += stride * kUnroll) {
      // a read-only op's loads all issued before its checks (whose stores may alias them)
      float xs[kUnroll][kIlp][D];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * stride;
#pragma unroll
        for (int d = 0; d < D; ++d) {
          if ((Op::kLoad >> d) & 1) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < vend && (!((Op::kOptional >> d) & 1) || p[d] != nullptr))
              v = *reinterpret_cast<const float4*>(p[d] + i);
            xs[u][0][d] = v.x, xs[u][1][d] = v.y, xs[u][2][d] = v.z, xs[u][3][d] = v.w;
          }
        }
      }
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) {  // (kUnroll > 1: read-only ops, nothing stored below)
        if (i0 + u * stride < vend) {
#pragma unroll
          for (int j = 0; j < kIlp; ++j) op(xs[u][j]);
        }
      }
      const int64_t i = i0;
      auto& x = xs[0];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) op(x[j]);
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if ((Op::kStore >> d) & 1)
          *reinterpret_cast<float4*>(p[d] + i) = make_float4(x[0][d], x[1][d], x[2][d], x[3][d]);
      }
      if constexpr (Op::kLowpFrom >= 0) {
        if (lp != nullptr) {
          constexpr int w = Op::kLowpFrom < 0 ? 0 : Op::kLowpFrom;
          uint2 h;
          h.x = lowp_bits(x[0][w], lt) | (lowp_bits(x[1][w], lt) << 16);
          h.y = lowp_bits(x[2][w], lt) | (lowp_bits(x[3][w], lt) << 16);
          *reinterpret_cast<uint2*>(lp + i) = h;
        }
      }
    }
    scalar_from = vend;  // the tensor's last < kIlp elements
  }
  // Scalar path: kIlp strided elements per thread and iteration (coalesced, any alignment).
  for (int64_t base = scalar_from; base < end; base += stride) {
    float x[kIlp][D];
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i >= end) continue;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if ((Op::kLoad >> d) & 1) x[j][d] = p[d] != nullptr ? p[d][i] : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kIlp; ++j) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i >= end) continue;
      op(x[j]);
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if ((Op::kStore >> d) & 1) p[d][i] = x[j][d];
      }
      if constexpr (Op::kLowpFrom >= 0) {
        constexpr int w = Op::kLowpFrom < 0 ? 0 : Op::kLowpFrom;
        if (lp != nullptr) lp[i] = static_cast<uint16_t>(lowp_bits(x[j][w], lt));
      }
    }
  }
}

// The host side of the multi-tensor apply: lists[s][i] is slot s's pointer for tensor i (lists[s]
// nullptr: every entry nullptr). Checks the arguments, then launches.
template <class Op, int kMaxTensors>
Status apply(int count, const int64_t* numels, void* const* const* lists, const InputType* lowp_types,
             const Op& op, const uint8_t* gate, Stream stream) {
  constexpr int S = slots<Op>();
  using L = Lists<S, kMaxTensors>;
  static_assert(sizeof(L) + sizeof(Op) <= kMaxParamBytes, "kernel arguments over 4 KiB");
  static_assert(kMaxTensors <= 255 && kMaxBlocks > 0, "block_tensor is 8-bit");
  if (count < 0 || (count > 0 && numels == nullptr)) return Status::kInvalidArgument;
  for (int i = 0; i < count; ++i) {
    if (numels[i] < 0) return Status::kInvalidArgument;
    if (numels[i] == 0) continue;
    for (int s = 0; s < Op::kDepth; ++s) {
      const bool given = lists[s] != nullptr && lists[s][i] != nullptr;
      if (!given && !((Op::kOptional >> s) & 1)) return Status::kInvalidArgument;
    }
    if (S > Op::kDepth && lists[S - 1] != nullptr && lists[S - 1][i] != nullptr) {
      if (lowp_types == nullptr || (lowp_types[i] != InputType::kFloat16 &&
                                    lowp_types[i] != InputType::kBFloat16))
        return Status::kInvalidArgument;
    }
  }
  auto launch = [&](const L& l, int blocks) {
    multi_tensor_kernel<Op, L><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(l, op, gate);
    return cudaGetLastError() == cudaSuccess;
  };
  L l;
  std::memset(&l, 0, sizeof(l));
  int nt = 0, nb = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = numels[i];
    if (n == 0) continue;
    for (int s = 0; s < S; ++s) l.ptr[s][nt] = lists[s] != nullptr ? lists[s][i] : nullptr;
    l.numel[nt] = n;
    l.lowp_type[nt] = 0;
    if (S > Op::kDepth && l.ptr[S - 1][nt] != nullptr) l.lowp_type[nt] = static_cast<uint8_t>(lowp_types[i]);
    ++nt;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      l.block_tensor[nb] = static_cast<uint8_t>(nt - 1);
      l.block_chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == kMaxBlocks || (nt == kMaxTensors && last_chunk)) {
        if (!launch(l, nb)) return Status::kCudaError;
        nb = 0;
        if (last_chunk) {
          nt = 0;
        } else {  // the tensor goes on in the next launch, as its slot 0
          for (int s = 0; s < S; ++s) l.ptr[s][0] = l.ptr[s][nt - 1];
          l.numel[0] = l.numel[nt - 1];
          l.lowp_type[0] = l.lowp_type[nt - 1];
          nt = 1;
        }
      }
    }
  }
  if (nb > 0 && !launch(l, nb)) return Status::kCudaError;
  return Status::kSuccess;
}

}  // namespace

Status onebit_momentum(int count, const int64_t* numels, float* const* out, const float* const* m,
                       const float* const* g, double beta1, Stream stream) {
  void* const* lists[] = {reinterpret_cast<void* const*>(out),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(m)),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(g))};
  const MomentumOp op{static_cast<float>(beta1), static_cast<float>(1.0 - beta1)};
  return apply<MomentumOp, 64>(count, numels, lists, nullptr, op, nullptr, stream);
}

Status onebit_compressed_step(int count, const int64_t* numels, const float* const* a, float* const* m,
                              const float* const* v, float* const* w, void* const* lowp,
                              const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream) {
  void* const* lists[] = {reinterpret_cast<void* const*>(const_cast<float* const*>(a)),
                          reinterpret_cast<void* const*>(m),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(v)),
                          reinterpret_cast<void* const*>(w), lowp};
  return apply<CompressedStepOp, 40>(count, numels, lists, lowp_types, CompressedStepOp{scalars_of(hyper)},
                                     gate, stream);
}

Status onebit_local_step(int count, const int64_t* numels, float* const* m, const float* const* v,
                         const float* const* g, float* const* w, void* const* lowp,
                         const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream) {
  void* const* lists[] = {reinterpret_cast<void* const*>(m),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(v)),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(g)),
                          reinterpret_cast<void* const*>(w), lowp};
  return apply<LocalStepOp, 40>(count, numels, lists, lowp_types, LocalStepOp{scalars_of(hyper)}, gate,
                                stream);
}

Status adam_warmup_step(int count, const int64_t* numels, float* const* m, float* const* v,
                        const float* const* g, float* const* w, void* const* lowp,
                        const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream) {
  void* const* lists[] = {reinterpret_cast<void* const*>(m), reinterpret_cast<void* const*>(v),
                          reinterpret_cast<void* const*>(const_cast<float* const*>(g)),
                          reinterpret_cast<void* const*>(w), lowp};
  return apply<WarmupStepOp, 40>(count, numels, lists, lowp_types, WarmupStepOp{scalars_of(hyper)}, gate,
                                 stream);
}

Status finite_gate(int count, const int64_t* numels, const float* const* x, uint8_t* gate, Stream stream) {
  if (gate == nullptr) return Status::kInvalidArgument;
  if (cudaMemsetAsync(gate, 1, 1, static_cast<cudaStream_t>(stream)) != cudaSuccess)
    return Status::kCudaError;
  void* const* lists[] = {reinterpret_cast<void* const*>(const_cast<float* const*>(x))};
  return apply<FiniteOp, 96>(count, numels, lists, nullptr, FiniteOp{gate}, nullptr, stream);
}

}  // namespace cuda
}  // namespace compcomm::kernels
