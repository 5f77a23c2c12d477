// Multi-tensor CUDA kernels of the 1-bit Adam update (python/compcomm/optim/functional.py is the
// contract: the same floating-point operations in the same order, each rounded to fp32, divisions
// true divisions, no contraction into FMAs -- so a float32 CPU evaluation of that op sequence is
// the oracle, bit for bit).
//
// Every call takes `count` tensors as parallel lists: entry i of each list points at numels[i]
// contiguous elements (fp32 unless said otherwise), pointers of one entry may differ in alignment
// (16-byte aligned entries take vectorised loads, others scalar ones). Entries of one list must not
// overlap other entries; `out` may alias `m` in onebit_momentum. Low-precision outputs: lowp may be
// nullptr (none in the call) or hold nullptr for an entry without one; lowp_types[i] is kFloat16 or
// kBFloat16 (round to nearest even) where lowp[i] is set. All work is queued on `stream` of the
// current device; the calls never allocate, never sync and never throw. kNotBuilt without CUDA.
// gate (the steps and lamb_stats; nullptr: none): a device byte that work queued earlier on the
// stream writes; where it is 0 the kernels write nothing (the gradients' finiteness verdict is
// computed on the device and gates the step, so the host launches without waiting for it).
#pragma once

#include <cstdint>

#include "cpu_lamb.h"
#include "kernels.h"

namespace compcomm::kernels {

// A parameter group's hyper-parameters, as the Python layer holds them (doubles). The kernels round
// each derived scalar to fp32 the way torch does for a python-float argument: 1 - beta is computed
// in double, then rounded.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = false;
  double bc1 = 1.0;       // 1 - beta1^t1 (used with bias_correction)
  double sqrt_bc2 = 1.0;  // sqrt(1 - beta2^t2) (used with bias_correction)
};

namespace cuda {

// out_i = m_i * b1 + (1-b1) * g_i (m_i nullptr: m = 0): 1-bit Adam's local momentum, the tensor the
// compressed allreduce averages. m is only read.
Status onebit_momentum(int count, const int64_t* numels, float* const* out, const float* const* m,
                       const float* const* g, double beta1, Stream stream);

// The compressed phase's commit and step, one pass: m = a; denom = sqrt(v) [/ sqrt_bc2] + eps;
// u = m / denom [/ bc1] [+ wd * w if wd > 0]; w = w + (-lr) * u; lowp = w rounded. v is only read.
Status onebit_compressed_step(int count, const int64_t* numels, const float* const* a, float* const* m,
                              const float* const* v, float* const* w, void* const* lowp,
                              const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream);

// The compressed phase at one rank (nothing to exchange), one pass: m = m*b1 + (1-b1)*g (as
// onebit_momentum), then the step of onebit_compressed_step with that m (the same bits as the two).
Status onebit_local_step(int count, const int64_t* numels, float* const* m, const float* const* v,
                         const float* const* g, float* const* w, void* const* lowp,
                         const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream);

// The warm-up (plain Adam) step, one pass: m = m*b1 + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g; then the step
// of onebit_compressed_step with these m, v.
Status adam_warmup_step(int count, const int64_t* numels, float* const* m, float* const* v,
                        const float* const* g, float* const* w, void* const* lowp,
                        const InputType* lowp_types, const AdamHyper& hyper, const uint8_t* gate,
                              Stream stream);

// gate = 1 if every element of the fp32 tensors x[i] is finite, else 0 (one device byte, written by
// work queued on stream: a memset, then one read-only pass): the `gate` the steps and lamb_stats
// take, without a host sync and with one launch per ~20M elements whatever the tensor count.
Status finite_gate(int count, const int64_t* numels, const float* const* x, uint8_t* gate, Stream stream);

// 1-bit LAMB's passes over lists of tensors (cpu_lamb.h's per-element operations, bit for bit, with
// the IEEE sqrt; c.sqrt is ignored): scales / steps are per tensor (count floats, host memory).
// lamb_stats takes last (after an exchange) or g (one rank: the momentum is updated in the pass),
// not both; partials: lamb_partials(count, numels) * 3 doubles of device scratch; out: 3 floats per
// tensor (device), the max ratio and the norms of u and of the update rounded to fp32.
int64_t lamb_partials(int count, const int64_t* numels);
Status lamb_momentum(const cpu::LambCoeffs& c, int count, const int64_t* numels, float* const* m,
                     const float* const* g, float* const* last, const float* scales, Stream stream);
Status lamb_stats(const cpu::LambCoeffs& c, int count, const int64_t* numels, float* const* m,
                  const float* const* last, const float* const* g, const float* const* v,
                  float* const* vf, const float* const* w, const float* scales, double* partials,
                  float* out, const uint8_t* gate, Stream stream);
Status lamb_apply(const cpu::LambCoeffs& c, int count, const int64_t* numels, const float* const* m,
                  const float* const* v, float* const* w, const float* steps, Stream stream);

}  // namespace cuda
}  // namespace compcomm::kernels
