// CPU Adam / AdamW and the 1-bit Adam updates: one multi-threaded, vectorised pass over w, m, v and
// the gradient (or the averaged momentum) per step, fp32 state, and optionally a copy of the new
// parameter in another dtype (the bf16/fp16 model weights next to an fp32 master) written in the
// same pass.
//
// Numerics. Every element is computed with the same sequence of IEEE fp32 operations whatever the
// instruction set (AVX-512, AVX2 or the generic scalar path), the thread count or the element's
// position, so results never depend on the machine's vector width: +, -, *, / and sqrt are
// correctly rounded, and where the reference rounds a multiply-add once (torch's CPU kernels do:
// `add_(x, alpha=a)`, `addcmul_` and `lerp_` are fused multiply-adds both in their vector loops and
// in their scalar tails) so do these kernels, with an explicit fma; nothing else is contracted (the
// file is compiled with -ffp-contract=off). The per-element sequences, with fl() the rounding to
// fp32:
//
//   kTorchAdam (torch.optim.Adam/AdamW, foreach=False, no amsgrad):
//     if decay != 1:  w = w * decay                            (AdamW: decay = fl(1 - lr*wd))
//     if l2 != 0:     g = fma(w, l2, g)                        (Adam with L2: l2 = fl(wd))
//     m = |lerp_w| < 0.5 ? fma(lerp_w, g - m, m) : fma(lerp_w - 1, g - m, g)   (torch's lerp_)
//     v = fma(fl(c2 * g), g, v * b2)                           (mul_(b2).addcmul_(g, g, value=c2))
//     w = w + fl(neg_step * m) / (sqrt(v) / bc2_sqrt + eps)    (addcdiv_; sqrt: see below)
//   kOneBitWarmup (compcomm.optim.functional: adam_moments_ then adam_step_):
//     m = fma(g, c1, m * b1);  v = fma(fl(c2 * g), g, v * b2);  then the 1-bit step below
//   kOneBitCompressed (m.copy_(averaged); masked_(m, mask); adam_step_ with the frozen bc2 step):
//     m = mask ? averaged * mask : averaged;  then the 1-bit step below
//   kOneBitLocal (a world of one rank: onebit_momentum, then kOneBitCompressed with that momentum as
//   the average; v read only):
//     m = fma(g, c1, m * b1);  then the 1-bit step below
//   kZeroOneLocal (0/1 Adam's local step: functional.zero_one_local_multi_ with accumulators; v
//   read only):
//     m = fma(g, c1, m * b1);  d and u as in the 1-bit step;  s = u * neg_lr;  w = w + s;
//     acc = acc + s
//   1-bit step (adam_denom / adam_update / adam_step_):
//     d = sqrt(v); if bias_correction: d = d / bc2_sqrt;  d = d + eps
//     u = m / d;   if bias_correction: u = u / bc1;        if weight_decay: u = fma(w, wd, u)
//     w = fma(u, neg_lr, w)
//     (a correction that has rounded to 1 is skipped: x / 1 is x exactly, so the bits are the same)
//
// sqrt. torch's CPU `Tensor.sqrt()` on x86 builds with MKL is MKL's vsSqrt (VML_HA), which on
// AVX-512 CPUs is not correctly rounded: it returns the other neighbour for ~0.6% of inputs (errors
// up to ~0.512 ulp). To reproduce torch bit for bit there, the kernels offer that sqrt too
// (SqrtMode kRsqrt14), established exhaustively against torch 2.13 / MKL 2024.2 for all 2^32
// inputs:
//   x == +-0 -> x;  x == +inf -> +inf;  x < 0 or NaN -> quiet NaN;
//   x < 2^-64: X = x * 2^64 (else X = x);  y = rsqrt14(X) (VRSQRT14PS);
//   s = X * y;  h = y * 0.5;  r = fma(-s, s, X) * h + s (one fma);  x < 2^-64: r = r * 2^-32.
// rsqrt14 is computed from its piecewise-linear form (64 segments on [1, 4) times powers of 4; Intel
// publishes a reference implementation, the coefficients here were fitted to the instruction's
// outputs and checked against it for every positive float), or by the instruction itself on CPUs
// where it gives the same bits (checked once, at first use), so every path gives the same bits. The
// caller picks the mode that matches the torch it compares with (compcomm.optim.cpu_adam probes
// torch once). kIeee is the correctly rounded sqrt (torch without MKL, torch on GPU, torch's fused
// CPU AdamW).
//
// The kernels take raw pointers and counts, never allocate and never throw; arguments are validated
// by the caller (cpp/bindings/optim_bindings.cpp).
#pragma once

#include <cstdint>

#include "kernels.h"

namespace compcomm::kernels::cpu {

// Which per-element sequence (above) adam_update applies.
enum class AdamRule : int {
  kTorchAdam = 0,
  kOneBitWarmup = 1,
  kOneBitCompressed = 2,
  kOneBitLocal = 3,
  // 0/1 Adam's local step (variance frozen): m = b1 m + (1-b1) g, s = fl(-lr) * update,
  // w += s, acc += s (the update accumulated since the last sync)
  kZeroOneLocal = 4
};

// The instruction set of the vector loop. kAuto: the widest the CPU supports (chosen at run time).
enum class AdamIsa : int { kAuto = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

// Which square root the update uses (see above).
enum class SqrtMode : int { kIeee = 0, kRsqrt14 = 1 };

// The fp32 scalars of one step, rounded once from the double expressions of the reference (torch's
// Python-level arithmetic): build them with adam_coeffs / onebit_coeffs.
struct AdamCoeffs {
  AdamRule rule = AdamRule::kTorchAdam;
  float b1 = 0.f;   // fl(beta1)                         1-bit: m * b1
  float c1 = 0.f;   // fl(1 - beta1)                     1-bit: alpha of add_; torch: lerp_ weight
  float b2 = 0.f;   // fl(beta2)
  float c2 = 0.f;   // fl(1 - beta2)                     value of addcmul_
  float eps = 0.f;  // fl(eps)
  float bc2_sqrt = 1.f;  // torch: fl((1 - beta2^t) ** 0.5); 1-bit: fl(sqrt(1 - beta2^bc2_t))
  // kTorchAdam
  float decay = 1.f;     // fl(1 - lr * wd) for AdamW, 1 otherwise
  float l2 = 0.f;        // fl(wd) for Adam with L2 (adamw_mode false), 0 otherwise
  float neg_step = 0.f;  // fl(-(lr / (1 - beta1^t)))  (lr without bias correction)
  // 1-bit rules
  float bc1 = 1.f;     // fl(1 - beta1^bc1_t)
  float wd = 0.f;      // fl(wd)
  float neg_lr = 0.f;  // fl(-lr)
  bool bias_correction = false;
  bool weight_decay = false;  // wd > 0
  // kOneBitCompressed / kOneBitLocal / kZeroOneLocal: v holds the frozen denominator d = sqrt(v) [/ bc2_sqrt] + eps,
  // computed once (ZeRO's no_allgather mode; the optimizers where torch's sqrt is not one of the
  // modes), and is read as d instead of recomputing it every step
  bool v_is_denom = false;
  SqrtMode sqrt = SqrtMode::kIeee;
};

// torch.optim.AdamW (adamw_mode) or torch.optim.Adam with L2 weight decay, at step `step` >= 1 (the
// step being taken). bias_correction false: DeepSpeed's CPU Adam without correction (step size lr,
// no variance correction).
AdamCoeffs adam_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                       int64_t step, bool adamw_mode, bool bias_correction);

// The 1-bit Adam rules of compcomm.optim.functional (rule: kOneBitWarmup, kOneBitCompressed or
// kOneBitLocal);
// bc1_t / bc2_t: the steps the corrections are taken at (0: no correction, as sqrt_bc).
AdamCoeffs onebit_coeffs(AdamRule rule, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, int64_t bc1_t, int64_t bc2_t);

// The arrays of one update, n elements each (contiguous).
struct AdamTensors {
  float* w = nullptr;  // parameter (or fp32 master), updated in place
  float* m = nullptr;  // first moment, updated in place
  float* v = nullptr;  // second moment, updated in place (read only in the 1-bit compressed rules)
  // kTorchAdam / kOneBitWarmup / kOneBitLocal: the gradient, of g_type. kOneBitCompressed: the
  // averaged momentum, fp32 (g_type must be kFloat32).
  const void* g = nullptr;
  InputType g_type = InputType::kFloat32;
  const float* mask = nullptr;  // kOneBitCompressed: exp_avg_mask, or nullptr for none
  void* param_out = nullptr;    // optional: the new w converted (round to nearest even) to out_type
  InputType out_type = InputType::kFloat32;
  float* acc = nullptr;  // kZeroOneLocal: the accumulated update, updated in place (required)
};

// Applies c.rule to n elements. num_threads <= 0: the OpenMP default (or the hardware concurrency
// without OpenMP); small n run on the calling thread. isa: kAuto, or a forced path (for tests);
// kInvalidArgument if that path is not built or not supported by this CPU, or for a null pointer or
// an fp32 requirement not met.
Status adam_update(const AdamCoeffs& c, const AdamTensors& t, int64_t n, int num_threads = 0,
                   AdamIsa isa = AdamIsa::kAuto);

// out = fma(g, c1, m * b1) for n fp32 elements (c = onebit_coeffs(...): 1-bit Adam's local momentum,
// bit for bit functional.onebit_momentum, the tensor a rank compresses); out may be m itself.
// Threads and kInvalidArgument as adam_update.
Status onebit_momentum(const AdamCoeffs& c, const float* m, const float* g, float* out, int64_t n,
                       int num_threads = 0, AdamIsa isa = AdamIsa::kAuto);

// Whether all n fp32 values at x are finite (no Inf, no NaN): one read-only pass, the check the
// optimizers run on the gradients before a step writes anything. kInvalidArgument as adam_update.
Status adam_all_finite(const float* x, int64_t n, bool* finite, AdamIsa isa = AdamIsa::kAuto);

// The same check for n 16-bit floats (type kFloat16 or kBFloat16) in their own dtype: 2 bytes read
// per element, no fp32 copy first (a value is not finite iff its exponent bits are all ones).
// kInvalidArgument for kFloat32, a null pointer or n < 0.
Status adam_all_finite_16(const uint16_t* x, int64_t n, InputType type, bool* finite);

// The path kAuto picks on this machine, and whether a given path can run here.
AdamIsa adam_best_isa();
bool adam_isa_supported(AdamIsa isa);
// "openmp" or "std::thread".
const char* adam_threading();

// out[i] = the square root of x[i] in `mode`, with the vector loop of `isa` (tests, and the probe
// that tells which sqrt torch uses). kInvalidArgument as adam_update.
Status adam_sqrt(const float* x, float* out, int64_t n, SqrtMode mode,
                 AdamIsa isa = AdamIsa::kAuto);

}  // namespace compcomm::kernels::cpu
