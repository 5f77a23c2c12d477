// 1-bit LAMB's compressed-phase step on the CPU (compcomm.optim.lamb.OneBitLamb), in three passes
// that give, element by element, the bits of the torch ops in compcomm.optim.functional
// (onebit_lamb_momentum_, onebit_lamb_update) with the same fp32 scalars:
//
//   lamb_momentum, before the exchange (m.mul_(b1).add_(g, alpha=1-b1).mul_(scale), m_last = m):
//     last = m;  m = fma(g, c1, m * b1);  if scale != 1: m = m * scale
//   lamb_stats, after it, per parameter (m holds the averaged scaled momentum):
//     if scale != 1: m = m / scale                                  (written back)
//     (with g, a world of one rank where the average is the momentum itself: last = m, then
//     m = fma(g, c1, m * b1), and if scale != 1: m = (m * scale) / scale, all in the one pass)
//     gh = (m - last * b1) / c1
//     vf = fma(c2 * gh, gh, vf * b2)                                (written back)
//     s = v_is_sqrt ? v : sqrt(v)
//     ratio = (s + eps) / (sqrt(vf) + eps)
//     u = bias_correction ? (m / (s / bc2 + eps)) / bc1 : m / (s + eps)
//     upd = weight_decay ? u + w * wd : u
//   and returns max(ratio) (NaN if any ratio is), sum(u^2) and sum(upd^2);
//   lamb_apply, once the caller has turned those into the step's coefficient:
//     w = w + upd * neg_step
// (a division by a correction that has rounded to 1 is skipped: x / 1 is x exactly; sqrt: the
// mode's, see cpu_adam.h.) Only the sums differ from torch's: fp64 sums of the exact squares, in a
// fixed order (element k into one of 8 partial sums by k % 8 within blocks that depend on n only),
// so the same value on every instruction set and thread count, where torch's float norms round
// differently. The caller rounds their square roots to fp32, as torch's norms are.
//
// Raw pointers and counts, no exceptions, no allocation; arguments are validated by the caller
// (cpp/bindings/optim_bindings.cpp).
#pragma once

#include <cstdint>

#include "cpu_adam.h"

namespace compcomm::kernels::cpu {

// The fp32 scalars, each rounded once from the Python double of the reference.
struct LambCoeffs {
  float b1 = 0.f, c1 = 0.f;  // fl(beta1), fl(1 - beta1)
  float b2 = 0.f, c2 = 0.f;  // fl(beta2), fl(1 - beta2)
  float eps = 0.f;
  float bc2 = 1.f;  // fl(sqrt(1 - beta2^freeze_step)) with bias correction
  float bc1 = 1.f;  // fl(1 - beta1^t) with bias correction
  float wd = 0.f;
  bool bias_correction = false;
  bool weight_decay = false;  // wd > 0
  bool v_is_sqrt = false;     // v holds sqrt(v) (frozen, computed by the caller)
  SqrtMode sqrt = SqrtMode::kIeee;
};

// One parameter's arrays, n fp32 elements each.
struct LambTensors {
  float* m = nullptr;           // momentum (a view of the fused buffer), written by lamb_stats
  const float* last = nullptr;  // the momentum before this step (lamb_stats without g)
  const float* g = nullptr;     // lamb_stats: the gradient (the momentum is updated in the pass)
  const float* v = nullptr;     // frozen variance (or its square root: v_is_sqrt)
  float* vf = nullptr;          // fresh variance, written by lamb_stats
  float* w = nullptr;           // parameter, written by lamb_apply
};

struct LambStats {
  float max_ratio = 0.f;
  double u_sq = 0.0, update_sq = 0.0;  // update_sq == u_sq without weight decay
};

// num_threads <= 0: the OpenMP default; isa as adam_update. kInvalidArgument for n < 0, a null
// pointer (n > 0) or an instruction set not available here.
Status lamb_momentum(const LambCoeffs& c, float scale, float* m, const float* g, float* last,
                     int64_t n, int num_threads = 0, AdamIsa isa = AdamIsa::kAuto);
Status lamb_stats(const LambCoeffs& c, float scale, const LambTensors& t, int64_t n, LambStats* out,
                  int num_threads = 0, AdamIsa isa = AdamIsa::kAuto);
Status lamb_apply(const LambCoeffs& c, float neg_step, const LambTensors& t, int64_t n,
                  int num_threads = 0, AdamIsa isa = AdamIsa::kAuto);

}  // namespace compcomm::kernels::cpu
