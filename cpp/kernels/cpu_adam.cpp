// CPU Adam / AdamW and the 1-bit Adam updates (see cpu_adam.h for the per-element numerics).
//
// How it is built. This one file is compiled up to three times (cpp/kernels/CMakeLists.txt):
//   - without COMPCOMM_ADAM_ISA: the entry points (coefficients, argument checks, the run-time
//   choice
//     of instruction set, the thread split) and the generic scalar loop;
//   - with COMPCOMM_ADAM_ISA=2 and -mavx2 -mfma -mf16c: the 8-wide loop;
//   - with COMPCOMM_ADAM_ISA=3 and -mavx512f ...: the 16-wide loop.
// The loop body below is one template over a vector type, so the three paths are the same sequence
// of operations by construction. Only the generic object may run on any CPU; everything in the
// others has internal linkage (an anonymous namespace, intrinsics only, no inline library
// functions) except the one function the dispatcher calls after checking the CPU, so no AVX code
// can leak into the generic path through a shared inline definition. Every object is compiled with
// -ffp-contract=off: the only fused multiply-adds are the explicit ones.
//
// The loop. Each thread gets one contiguous range (a multiple of 64 elements); within it, full
// vectors are processed in place and the last partial vector is copied to stack buffers, processed
// by the same vector code and copied back, so the tail needs no scalar twin (and gives the same
// results).
#include "cpu_adam.h"
#include "cpu_vec.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(COMPCOMM_ADAM_ISA)
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "half.h"
#if defined(_OPENMP)
#include <omp.h>
#endif
#else
#include <immintrin.h>
#endif

namespace compcomm::kernels::cpu {

// The range function each object provides: applies the rule to elements [begin, end).
using AdamRangeFn = void (*)(const AdamCoeffs&, const AdamTensors&, int64_t begin, int64_t end);

namespace detail {
// Defined in the AVX2 / AVX-512 objects (present when COMPCOMM_ADAM_X86 is defined): the range
// function for this rule and these dtypes, or nullptr if the combination is not supported.
AdamRangeFn adam_pick_avx2(const AdamCoeffs& c, const AdamTensors& t);
AdamRangeFn adam_pick_avx512(const AdamCoeffs& c, const AdamTensors& t);
void adam_sqrt_avx2(const float* x, float* out, int64_t n, SqrtMode mode);
void adam_sqrt_avx512(const float* x, float* out, int64_t n, SqrtMode mode);
bool adam_all_finite_avx2(const float* x, int64_t n);
bool adam_all_finite_avx512(const float* x, int64_t n);
using MomentumFn = void (*)(const AdamCoeffs&, const float*, const float*, float*, int64_t, int64_t);
MomentumFn momentum_pick_avx2();
MomentumFn momentum_pick_avx512();
}  // namespace detail

namespace {

// The 1-bit compressed rules freeze the variance: v is only read.
template <AdamRule R>
constexpr bool kWritesV = R == AdamRule::kTorchAdam || R == AdamRule::kOneBitWarmup;

// One step over V::kWidth elements at the given pointers. The constants are splatted once per
// range.
template <class V, AdamRule R, class G, class O>
struct AdamBody {
  using T = typename V::T;
  T b1, c1, lerp_w, b2, c2, eps, bc2_sqrt, decay, l2, neg_step, bc1, wd, neg_lr;
  bool lerp_small, use_decay, use_l2, div_bc1, div_bc2, weight_decay, has_mask, ieee_sqrt, v_is_denom;

  explicit AdamBody(const AdamCoeffs& c, bool mask)
      : b1(V::set1(c.b1)),
        c1(V::set1(c.c1)),
        // torch's lerp_: weight if |weight| < 0.5, else weight - 1 (in fp32) from the other end
        lerp_w(V::set1((c.c1 < 0.5f && c.c1 > -0.5f) ? c.c1 : c.c1 - 1.f)),
        b2(V::set1(c.b2)),
        c2(V::set1(c.c2)),
        eps(V::set1(c.eps)),
        bc2_sqrt(V::set1(c.bc2_sqrt)),
        decay(V::set1(c.decay)),
        l2(V::set1(c.l2)),
        neg_step(V::set1(c.neg_step)),
        bc1(V::set1(c.bc1)),
        wd(V::set1(c.wd)),
        neg_lr(V::set1(c.neg_lr)),
        lerp_small(c.c1 < 0.5f && c.c1 > -0.5f),
        use_decay(c.decay != 1.f),
        use_l2(c.l2 != 0.f),
        // x / 1 is x exactly: a correction that has reached 1 (late steps) costs no division
        div_bc1(c.bias_correction && c.bc1 != 1.f),
        div_bc2(c.bias_correction && c.bc2_sqrt != 1.f),
        weight_decay(c.weight_decay),
        has_mask(mask),
        ieee_sqrt(c.sqrt == SqrtMode::kIeee),
        v_is_denom(c.v_is_denom) {}

  void operator()(float* w, float* m, float* v, const G* g, const float* mask, O* out, float* acc,
                  bool stream_m, bool stream_out) const {
    T wv = V::load(w);
    T mv, vv = V::load(v);
    if constexpr (R == AdamRule::kTorchAdam) {
      T gv = V::load(g);
      if (use_decay) wv = V::mul(wv, decay);
      if (use_l2) gv = V::fma(wv, l2, gv);
      mv = V::load(m);
      const T d = V::sub(gv, mv);
      mv = V::fma(lerp_w, d, lerp_small ? mv : gv);
      vv = V::fma(V::mul(c2, gv), gv, V::mul(vv, b2));
      const T den = V::add(V::div(sqrt_of<V>(vv, ieee_sqrt), bc2_sqrt), eps);
      wv = V::add(wv, V::div(V::mul(neg_step, mv), den));
    } else {
      if constexpr (R == AdamRule::kOneBitWarmup || R == AdamRule::kOneBitLocal ||
                    R == AdamRule::kZeroOneLocal) {
        const T gv = V::load(g);
        mv = V::fma(gv, c1, V::mul(V::load(m), b1));
        if constexpr (R == AdamRule::kOneBitWarmup) vv = V::fma(V::mul(c2, gv), gv, V::mul(vv, b2));
      } else {  // kOneBitCompressed: g is the averaged momentum
        mv = V::load(g);
        if (has_mask) mv = V::mul(mv, V::load(mask));
      }
      T den = vv;
      if (!v_is_denom) {
        den = sqrt_of<V>(vv, ieee_sqrt);
        if (div_bc2) den = V::div(den, bc2_sqrt);
        den = V::add(den, eps);
      }
      T u = V::div(mv, den);
      if (div_bc1) u = V::div(u, bc1);
      if (weight_decay) u = V::fma(wv, wd, u);
      if constexpr (R == AdamRule::kZeroOneLocal) {  // the step is rounded, then added twice
        const T s = V::mul(u, neg_lr);
        wv = V::add(wv, s);
        V::store(acc, V::add(V::load(acc), s));
      } else {
        wv = V::fma(u, neg_lr, wv);
      }
    }
    V::store(w, wv);
    if (stream_m)
      V::stream(m, mv);
    else
      V::store(m, mv);
    if constexpr (kWritesV<R>) V::store(v, vv);
    if constexpr (!std::is_same_v<O, NoOut>) {
      if (stream_out)
        V::stream(out, wv);
      else
        V::store(out, wv);
    }
  }
};

// Elements to process before p (elements of `size` bytes) is `align`-aligned; -1 if it never is.
inline int64_t head_to_align(const void* p, int64_t size, int64_t align) {
  const auto mis =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(align));
  if (mis % size != 0) return -1;
  return (align - mis) % align / size;
}

// Software prefetch distance of the update loop, in elements (a hint: no effect on results; a
// prefetch past the end of an array does not fault).
constexpr int64_t kPrefetch = 256;

template <class V, AdamRule R, class G, class O>
void adam_range(const AdamCoeffs& c, const AdamTensors& t, int64_t begin, int64_t end) {
  constexpr int64_t W = V::kWidth;
  constexpr bool kOut = !std::is_same_v<O, NoOut>;
  const AdamBody<V, R, G, O> body(c, t.mask != nullptr);
  const G* g = static_cast<const G*>(t.g);
  O* out = static_cast<O*>(t.param_out);
  const float* mask = t.mask;
  // r < W elements at i, through stack buffers (zero-padded: no traps; the padding is not written
  // back): the partial vectors at the ends of the range run the same vector code.
  auto partial = [&](int64_t i, int64_t r) {
    if (r <= 0) return;
    float wb[W] = {}, mb[W] = {}, vb[W] = {}, kb[W] = {}, ab[W] = {};
    G gb[W] = {};
    O ob[W] = {};
    std::memcpy(wb, t.w + i, r * sizeof(float));
    std::memcpy(mb, t.m + i, r * sizeof(float));
    std::memcpy(vb, t.v + i, r * sizeof(float));
    std::memcpy(gb, g + i, r * sizeof(G));
    if (mask) std::memcpy(kb, mask + i, r * sizeof(float));
    if constexpr (R == AdamRule::kZeroOneLocal) std::memcpy(ab, t.acc + i, r * sizeof(float));
    body(wb, mb, vb, gb, mask ? kb : nullptr, ob, ab, false, false);
    std::memcpy(t.w + i, wb, r * sizeof(float));
    std::memcpy(t.m + i, mb, r * sizeof(float));
    if constexpr (R == AdamRule::kZeroOneLocal) std::memcpy(t.acc + i, ab, r * sizeof(float));
    if constexpr (kWritesV<R>) std::memcpy(t.v + i, vb, r * sizeof(float));
    if constexpr (kOut) std::memcpy(out + i, ob, r * sizeof(O));
  };
  // Arrays that are only written (the compressed rule's m, the parameter copy) are written with
  // non-temporal stores on long ranges: no read-for-ownership of their lines, 4 (or 2) bytes per
  // element less traffic. That needs them aligned, so a partial vector may come first.
  constexpr int64_t kStreamMin = int64_t{1} << 14;
  bool stream_m = false, stream_out = false;
  int64_t i = begin;
  if constexpr (W > 1) {
    if (end - begin >= kStreamMin) {
      int64_t head = -1;
      if constexpr (R == AdamRule::kOneBitCompressed)
        head = head_to_align(t.m + i, sizeof(float), W * 4);
      if constexpr (kOut) {
        if (head < 0) head = head_to_align(out + i, sizeof(O), W * sizeof(O));
      }
      if (head >= 0) {
        partial(i, head);
        i += head;
        stream_m =
            R == AdamRule::kOneBitCompressed && head_to_align(t.m + i, sizeof(float), W * 4) == 0;
        if constexpr (kOut) stream_out = head_to_align(out + i, sizeof(O), W * sizeof(O)) == 0;
      }
    }
  }
  // local copies: the compiler cannot tell that the float stores leave t's pointers alone and
  // would reload them every iteration
  float* const w = t.w;
  float* const m = t.m;
  float* const v = t.v;
  float* const acc = t.acc;
  for (; i + W <= end; i += W) {
    if constexpr (W > 1) {
      // the streams the pass reads, kPrefetch elements ahead; not m where it is only written.
      // One core of the 2-core VM, cold caches, 8.4M parameters in 100 arrays: 9.1-9.6 -> 8.5-8.9
      // ms in a C++ loop over the kernel; no change measurable through the Python bench (the pass
      // is at the memory floor there either way)
      if (i + kPrefetch < end) {
        __builtin_prefetch(w + i + kPrefetch, 1);
        if constexpr (R != AdamRule::kOneBitCompressed) __builtin_prefetch(m + i + kPrefetch, 1);
        __builtin_prefetch(v + i + kPrefetch, kWritesV<R> ? 1 : 0);
        __builtin_prefetch(g + i + kPrefetch, 0);
        if constexpr (R == AdamRule::kZeroOneLocal) __builtin_prefetch(acc + i + kPrefetch, 1);
      }
    }
    body(w + i, m + i, v + i, g + i, mask ? mask + i : nullptr, kOut ? out + i : nullptr,
         R == AdamRule::kZeroOneLocal ? acc + i : nullptr, stream_m, stream_out);
  }
  if constexpr (W > 1) partial(i, end - i);
  if (stream_m || stream_out) V::fence();  // order the non-temporal stores before the caller's sync
}

// The instantiation for a rule and the dtypes of t (nullptr: not supported).
template <class V, AdamRule R, class G>
AdamRangeFn pick_out(const AdamTensors& t) {
  if (t.param_out == nullptr) return &adam_range<V, R, G, NoOut>;
  switch (t.out_type) {
    case InputType::kFloat32:
      return &adam_range<V, R, G, float>;
    case InputType::kFloat16:
      return &adam_range<V, R, G, F16>;
    case InputType::kBFloat16:
      return &adam_range<V, R, G, Bf16>;
  }
  return nullptr;
}

template <class V, AdamRule R>
AdamRangeFn pick_grad(const AdamTensors& t) {
  switch (t.g_type) {
    case InputType::kFloat32:
      return pick_out<V, R, float>(t);
    case InputType::kFloat16:
      return pick_out<V, R, F16>(t);
    case InputType::kBFloat16:
      return pick_out<V, R, Bf16>(t);
  }
  return nullptr;
}

template <class V>
AdamRangeFn pick(const AdamCoeffs& c, const AdamTensors& t) {
  switch (c.rule) {
    case AdamRule::kTorchAdam:
      return pick_grad<V, AdamRule::kTorchAdam>(t);
    case AdamRule::kOneBitWarmup:
      return pick_grad<V, AdamRule::kOneBitWarmup>(t);
    case AdamRule::kOneBitLocal:
      return pick_grad<V, AdamRule::kOneBitLocal>(t);
    case AdamRule::kZeroOneLocal:
      return pick_grad<V, AdamRule::kZeroOneLocal>(t);
    case AdamRule::kOneBitCompressed:  // the averaged momentum is fp32
      return t.g_type == InputType::kFloat32 ? pick_out<V, AdamRule::kOneBitCompressed, float>(t)
                                             : nullptr;
  }
  return nullptr;
}

// out[i] = fma(g, c1, m * b1) over [begin, end); the partial vector at the end through a buffer.
template <class V>
void momentum_range(const AdamCoeffs& c, const float* m, const float* g, float* out, int64_t begin,
                    int64_t end) {
  constexpr int64_t W = V::kWidth;
  const typename V::T b1 = V::set1(c.b1), c1 = V::set1(c.c1);
  int64_t i = begin;
  for (; i + W <= end; i += W)
    V::store(out + i, V::fma(V::load(g + i), c1, V::mul(V::load(m + i), b1)));
  if constexpr (W > 1) {
    if (i < end) {
      float mb[W] = {}, gb[W] = {};
      std::memcpy(mb, m + i, (end - i) * sizeof(float));
      std::memcpy(gb, g + i, (end - i) * sizeof(float));
      V::store(mb, V::fma(V::load(gb), c1, V::mul(V::load(mb), b1)));
      std::memcpy(out + i, mb, (end - i) * sizeof(float));
    }
  }
}

// x * 0 is +-0 for a finite x and NaN for Inf or NaN, and a sum of zeros stays zero while NaN
// propagates: four independent sums of x * 0, NaN at the end iff some value was not finite. The
// four read streams a quarter of the range apart, not side by side: one core keeps more reads in
// flight from four places (a Zen 3 core checked 8.4M floats 1.2x faster, and 16-bit 1.6x).
template <class V>
bool all_finite_range(const float* x, int64_t n) {
  constexpr int64_t W = V::kWidth;
  const typename V::T zero = V::set1(0.f);
  typename V::T a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  const int64_t q = n / (4 * W) * W;  // each stream's share, whole vectors
  const float *x1 = x + q, *x2 = x + 2 * q, *x3 = x + 3 * q;
  for (int64_t i = 0; i < q; i += W) {
    a0 = V::add(a0, V::mul(V::load(x + i), zero));
    a1 = V::add(a1, V::mul(V::load(x1 + i), zero));
    a2 = V::add(a2, V::mul(V::load(x2 + i), zero));
    a3 = V::add(a3, V::mul(V::load(x3 + i), zero));
  }
  int64_t i = 4 * q;
  for (; i + W <= n; i += W) a0 = V::add(a0, V::mul(V::load(x + i), zero));
  if constexpr (W > 1) {
    if (i < n) {
      float b[W] = {};
      std::memcpy(b, x + i, (n - i) * sizeof(float));
      a1 = V::add(a1, V::mul(V::load(b), zero));
    }
  }
  float s[W];
  V::store(s, V::add(V::add(a0, a1), V::add(a2, a3)));
  bool ok = true;
  for (int64_t k = 0; k < W; ++k) ok = ok && s[k] == 0.f;
  return ok;
}

template <class V>
void sqrt_range(const float* x, float* out, int64_t n, SqrtMode mode) {
  constexpr int64_t W = V::kWidth;
  const bool ieee = mode == SqrtMode::kIeee;
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(out + i, sqrt_of<V>(V::load(x + i), ieee));
  if constexpr (W > 1) {
    if (i < n) {
      float b[W] = {};
      std::memcpy(b, x + i, (n - i) * sizeof(float));
      V::store(b, sqrt_of<V>(V::load(b), ieee));
      std::memcpy(out + i, b, (n - i) * sizeof(float));
    }
  }
}


}  // namespace

#if defined(COMPCOMM_ADAM_ISA) && COMPCOMM_ADAM_ISA == 2
AdamRangeFn detail::adam_pick_avx2(const AdamCoeffs& c, const AdamTensors& t) {
  return pick<Avx2>(c, t);
}
void detail::adam_sqrt_avx2(const float* x, float* out, int64_t n, SqrtMode mode) {
  sqrt_range<Avx2>(x, out, n, mode);
}
bool detail::adam_all_finite_avx2(const float* x, int64_t n) { return all_finite_range<Avx2>(x, n); }
detail::MomentumFn detail::momentum_pick_avx2() { return &momentum_range<Avx2>; }
#elif defined(COMPCOMM_ADAM_ISA) && COMPCOMM_ADAM_ISA == 3
AdamRangeFn detail::adam_pick_avx512(const AdamCoeffs& c, const AdamTensors& t) {
  static const bool hw = rsqrt14_hw_matches();
  return hw ? pick<Avx512Hw>(c, t) : pick<Avx512>(c, t);
}
void detail::adam_sqrt_avx512(const float* x, float* out, int64_t n, SqrtMode mode) {
  static const bool hw = rsqrt14_hw_matches();
  hw ? sqrt_range<Avx512Hw>(x, out, n, mode) : sqrt_range<Avx512>(x, out, n, mode);
}
bool detail::adam_all_finite_avx512(const float* x, int64_t n) {
  return all_finite_range<Avx512>(x, n);
}
detail::MomentumFn detail::momentum_pick_avx512() { return &momentum_range<Avx512>; }
#else
// ------------------------------------------------------------------------------------------------
// Entry points (generic object only).
// ------------------------------------------------------------------------------------------------

AdamCoeffs adam_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                       int64_t step, bool adamw_mode, bool bias_correction) {
  // The double expressions are torch.optim.adam._single_tensor_adam's, in its order.
  AdamCoeffs c;
  c.rule = AdamRule::kTorchAdam;
  c.b1 = static_cast<float>(beta1);
  c.c1 = static_cast<float>(1.0 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.c2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  const double t = static_cast<double>(step);
  double step_size = lr;
  if (bias_correction) {
    step_size = lr / (1.0 - std::pow(beta1, t));
    c.bc2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, t), 0.5));
  }
  c.neg_step = static_cast<float>(-step_size);
  if (weight_decay != 0.0) {
    if (adamw_mode)
      c.decay = static_cast<float>(1.0 - lr * weight_decay);
    else
      c.l2 = static_cast<float>(weight_decay);
  }
  c.bias_correction = bias_correction;
  c.wd = static_cast<float>(weight_decay);
  c.neg_lr = static_cast<float>(-lr);
  return c;
}

AdamCoeffs onebit_coeffs(AdamRule rule, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, int64_t bc1_t, int64_t bc2_t) {
  // compcomm.optim.functional's Python arithmetic: sqrt_bc, 1.0 - b1 ** t, 1 - b1, -lr.
  AdamCoeffs c;
  c.rule = rule;
  c.b1 = static_cast<float>(beta1);
  c.c1 = static_cast<float>(1.0 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.c2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.bias_correction = bias_correction;
  if (bias_correction) {
    c.bc2_sqrt =
        bc2_t > 0 ? static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(bc2_t))))
                  : 1.f;
    c.bc1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(bc1_t)));
  }
  c.weight_decay = weight_decay > 0.0;
  c.wd = static_cast<float>(weight_decay);
  c.neg_lr = static_cast<float>(-lr);
  c.neg_step = c.neg_lr;
  return c;
}

bool adam_isa_supported(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAuto:
    case AdamIsa::kGeneric:
      return true;
#if defined(COMPCOMM_ADAM_X86)
    case AdamIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case AdamIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    case AdamIsa::kAvx2:
    case AdamIsa::kAvx512:
      return false;
#endif
  }
  return false;
}

AdamIsa adam_best_isa() {
  static const AdamIsa best = adam_isa_supported(AdamIsa::kAvx512) ? AdamIsa::kAvx512
                              : adam_isa_supported(AdamIsa::kAvx2) ? AdamIsa::kAvx2
                                                                   : AdamIsa::kGeneric;
  return best;
}

const char* adam_threading() {
#if defined(_OPENMP)
  return "openmp";
#else
  return "std::thread";
#endif
}

namespace {

AdamRangeFn pick_for(AdamIsa isa, const AdamCoeffs& c, const AdamTensors& t) {
  switch (isa) {
#if defined(COMPCOMM_ADAM_X86)
    case AdamIsa::kAvx512:
      return detail::adam_pick_avx512(c, t);
    case AdamIsa::kAvx2:
      return detail::adam_pick_avx2(c, t);
#endif
    case AdamIsa::kGeneric:
      return pick<Scalar>(c, t);
    default:
      return nullptr;
  }
}

int default_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

}  // namespace

Status adam_update(const AdamCoeffs& c, const AdamTensors& t, int64_t n, int num_threads,
                   AdamIsa isa) {
  if (n < 0) return Status::kInvalidArgument;
  if (n == 0) return Status::kSuccess;
  if (!t.w || !t.m || !t.v || !t.g) return Status::kInvalidArgument;
  // only the compressed rules have a frozen variance to hold as its denominator
  if (c.v_is_denom && (c.rule == AdamRule::kTorchAdam || c.rule == AdamRule::kOneBitWarmup))
    return Status::kInvalidArgument;
  if ((c.rule == AdamRule::kZeroOneLocal) != (t.acc != nullptr)) return Status::kInvalidArgument;
  if (isa == AdamIsa::kAuto) isa = adam_best_isa();
  if (!adam_isa_supported(isa)) return Status::kInvalidArgument;
  const AdamRangeFn f = pick_for(isa, c, t);
  if (f == nullptr) return Status::kInvalidArgument;

  // Below ~32K elements per thread, waking threads costs more than it saves (torch's grain size).
  constexpr int64_t kGrain = 32768, kAlign = 64;
  int64_t nt = num_threads > 0 ? num_threads : default_threads();
  nt = std::max<int64_t>(1, std::min<int64_t>(nt, (n + kGrain - 1) / kGrain));
  if (nt == 1) {
    f(c, t, 0, n);
    return Status::kSuccess;
  }
  const int64_t chunk = ((n + nt - 1) / nt + kAlign - 1) / kAlign * kAlign;
  auto run = [&](int64_t i) {
    const int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b < e) f(c, t, b, e);
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(static_cast<int>(nt))
  {
    const int64_t got = omp_get_num_threads();
    for (int64_t i = omp_get_thread_num(); i < nt; i += got) run(i);
  }
#else
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(nt - 1));
  for (int64_t i = 1; i < nt; ++i) pool.emplace_back(run, i);
  run(0);
  for (auto& th : pool) th.join();
#endif
  return Status::kSuccess;
}

Status onebit_momentum(const AdamCoeffs& c, const float* m, const float* g, float* out, int64_t n,
                       int num_threads, AdamIsa isa) {
  if (n < 0 || (n > 0 && (!m || !g || !out))) return Status::kInvalidArgument;
  if (n == 0) return Status::kSuccess;
  if (isa == AdamIsa::kAuto) isa = adam_best_isa();
  if (!adam_isa_supported(isa)) return Status::kInvalidArgument;
  detail::MomentumFn f = &momentum_range<Scalar>;
#if defined(COMPCOMM_ADAM_X86)
  if (isa == AdamIsa::kAvx512) f = detail::momentum_pick_avx512();
  if (isa == AdamIsa::kAvx2) f = detail::momentum_pick_avx2();
#endif
  // the split of adam_update (a memory-bound pass: threads only for large n)
  constexpr int64_t kGrain = 32768, kAlign = 64;
  int64_t nt = num_threads > 0 ? num_threads : default_threads();
  nt = std::max<int64_t>(1, std::min<int64_t>(nt, (n + kGrain - 1) / kGrain));
  if (nt == 1) {
    f(c, m, g, out, 0, n);
    return Status::kSuccess;
  }
  const int64_t chunk = ((n + nt - 1) / nt + kAlign - 1) / kAlign * kAlign;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(static_cast<int>(nt))
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b < e) f(c, m, g, out, b, e);
  }
#else
  std::vector<std::thread> pool;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back(f, std::cref(c), m, g, out, b, e);
  }
  for (auto& th : pool) th.join();
#endif
  return Status::kSuccess;
}

Status adam_all_finite(const float* x, int64_t n, bool* finite, AdamIsa isa) {
  if (n < 0 || !finite || (n > 0 && !x)) return Status::kInvalidArgument;
  if (isa == AdamIsa::kAuto) isa = adam_best_isa();
  if (!adam_isa_supported(isa)) return Status::kInvalidArgument;
  switch (isa) {
#if defined(COMPCOMM_ADAM_X86)
    case AdamIsa::kAvx512:
      *finite = detail::adam_all_finite_avx512(x, n);
      break;
    case AdamIsa::kAvx2:
      *finite = detail::adam_all_finite_avx2(x, n);
      break;
#endif
    default:
      *finite = all_finite_range<Scalar>(x, n);
  }
  return Status::kSuccess;
}

// Four lanes per 64-bit word: t = (x & E) ^ E is zero in a lane iff its exponent is all ones, and
// bit 15 of t is always clear, so t + 0x7fff carries into bit 15 iff the lane is finite (no carry
// leaves the lane). One AND-accumulated word per 4 elements; the compiler vectorises the loop.
Status adam_all_finite_16(const uint16_t* x, int64_t n, InputType type, bool* finite) {
  if (n < 0 || !finite || (n > 0 && !x) || type == InputType::kFloat32)
    return Status::kInvalidArgument;
  const uint16_t e = type == InputType::kBFloat16 ? 0x7f80 : 0x7c00;
  const uint64_t kE = 0x0001000100010001ull * e, kLow = 0x7fff7fff7fff7fffull,
                 kTop = 0x8000800080008000ull;
  // four streams a quarter of the range apart (as in all_finite_range), two words each
  const int64_t q = n / 32 * 8;
  uint64_t a[4][2] = {{kTop, kTop}, {kTop, kTop}, {kTop, kTop}, {kTop, kTop}};
  for (int64_t i = 0; i < q; i += 8)
    for (int s = 0; s < 4; ++s) {
      uint64_t w0, w1;
      std::memcpy(&w0, x + s * q + i, 8);  // no alignment assumed; compiles to plain loads
      std::memcpy(&w1, x + s * q + i + 4, 8);
      a[s][0] &= (((w0 & kE) ^ kE) + kLow);
      a[s][1] &= (((w1 & kE) ^ kE) + kLow);
    }
  uint64_t all = kTop;
  for (const auto& r : a) all &= r[0] & r[1];
  bool ok = (all & kTop) == kTop;
  int64_t i = 4 * q;
  for (; i < n; ++i) ok = ok && (x[i] & e) != e;
  *finite = ok;
  return Status::kSuccess;
}

Status adam_sqrt(const float* x, float* out, int64_t n, SqrtMode mode, AdamIsa isa) {
  if (n < 0 || (n > 0 && (!x || !out))) return Status::kInvalidArgument;
  if (isa == AdamIsa::kAuto) isa = adam_best_isa();
  if (!adam_isa_supported(isa)) return Status::kInvalidArgument;
  switch (isa) {
#if defined(COMPCOMM_ADAM_X86)
    case AdamIsa::kAvx512:
      detail::adam_sqrt_avx512(x, out, n, mode);
      break;
    case AdamIsa::kAvx2:
      detail::adam_sqrt_avx2(x, out, n, mode);
      break;
#endif
    default:
      sqrt_range<Scalar>(x, out, n, mode);
  }
  return Status::kSuccess;
}

#endif  // entry points

}  // namespace compcomm::kernels::cpu
