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

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
struct NoOut {};  // no parameter copy

// rsqrt14 (VRSQRT14PS) on [1, 4): 64 segments (32 on [1, 2), 32 on [2, 4)) indexed by the
// exponent's parity and the top 5 fraction bits; within one, with t the next 10 fraction bits, the
// 17-bit significand of the result is (kRsqrtC - kRsqrtD * t) >> 9 (value in [0.5, 1) as a multiple
// of 2^-17). Outside [1, 4) the result scales by powers of 2 (rsqrt(4^q x) = 2^-q rsqrt(x)), and
// exact powers of 4 give exact results. The coefficients were fitted to the instruction's outputs
// for all 2^24 inputs in [1, 4) (every one reproduced) and the whole function checked against it
// for every positive float.
alignas(64) constexpr int32_t kRsqrtC[64] = {
    67105920, 66080896, 65102464, 64166144, 63268608, 62407552, 61580928, 60786816,
    60022016, 59285632, 58575744, 57891328, 57229568, 56589568, 55971712, 55373184,
    54793088, 54231424, 53686144, 53156864, 52643456, 52144512, 51659776, 51188096,
    50728832, 50281856, 49847040, 49422080, 49008512, 48605952, 48211840, 47828224,
    47450752, 46726272, 46034432, 45371904, 44738048, 44129152, 43544704, 42982528,
    42442368, 41921920, 41419392, 40935040, 40467072, 40015104, 39577728, 39155072,
    38744960, 38347136, 37961600, 37588096, 37224832, 36871936, 36528640, 36195328,
    35870976, 35554944, 35246976, 34946816, 34654848, 34369152, 34091008, 33819392};
alignas(64) constexpr int32_t kRsqrtD[64] = {
    1001, 955, 915, 877, 841, 807, 775, 747, 719, 693, 669, 647, 625, 603, 585, 567,
    549,  533, 517, 501, 487, 473, 461, 449, 437, 425, 415, 403, 393, 385, 375, 367,
    707,  675, 647, 619, 595, 571, 549, 527, 509, 491, 473, 457, 441, 427, 413, 401,
    389,  377, 365, 355, 345, 335, 325, 317, 309, 301, 293, 285, 279, 271, 265, 259};
constexpr float kSqrtTiny = 0x1p-64f, kSqrtUp = 0x1p64f, kSqrtDown = 0x1p-32f;

// The square root of the mode (cpu_adam.h), in V's operations.
template <class V>
typename V::T sqrt_of(typename V::T x, bool ieee) {
  if (ieee) return V::sqrt(x);
  if (V::all_normal(x)) {  // the common case: every lane in [2^-64, inf), nothing to scale or fix
    const auto y = V::rsqrt14(x);
    const auto s = V::mul(x, y), h = V::mul(y, V::set1(0.5f));
    return V::fma(V::fma(V::neg(s), s, x), h, s);
  }
  const auto small = V::less(x, V::set1(kSqrtTiny));
  const auto xs = V::select(small, V::mul(x, V::set1(kSqrtUp)), x);
  const auto y = V::rsqrt14(xs);
  const auto s = V::mul(xs, y), h = V::mul(y, V::set1(0.5f));
  auto r = V::fma(V::fma(V::neg(s), s, xs), h, s);
  r = V::select(small, V::mul(r, V::set1(kSqrtDown)), r);
  return V::fix_specials(x, r);  // +-0, +inf, negative and NaN inputs
}

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

// ------------------------------------------------------------------------------------------------
// The vector types. Each provides T, kWidth, set1, load/store for float, Bf16 and F16, and the
// correctly rounded add, sub, mul, div, sqrt and fma. bf16 stores round to nearest even (a quiet
// NaN keeps its sign and top payload bits), as torch's conversion. For the rsqrt14 sqrt: all_normal
// (every lane in [2^-64, +inf)), less (a mask), select(mask, a, b), neg, rsqrt14 (of a positive
// normal float; anything for other inputs) and fix_specials(x, r) (r, except x for +-0 and +inf,
// and a quiet NaN for x < 0 and NaN).
// ------------------------------------------------------------------------------------------------
#if !defined(COMPCOMM_ADAM_ISA)

struct Scalar {
  using T = float;
  static constexpr int kWidth = 1;
  static T set1(float x) { return x; }
  static T load(const float* p) { return *p; }
  static T load(const Bf16* p) { return half::bf16_to_float(p->bits); }
  static T load(const F16* p) { return half::half_to_float(p->bits); }
  static void store(float* p, T x) { *p = x; }
  static void store(Bf16* p, T x) { p->bits = half::float_to_bf16(x); }
  static void store(F16* p, T x) { p->bits = half::float_to_half(x); }
  template <class P>
  static void stream(P* p, T x) {
    store(p, x);
  }
  static void fence() {}
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T sqrt(T a) { return std::sqrt(a); }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
  static T neg(T a) { return -a; }
  static bool less(T a, T b) { return a < b; }
  static bool all_normal(T a) {
    return a >= kSqrtTiny && a < std::numeric_limits<float>::infinity();
  }
  static T select(bool m, T a, T b) { return m ? a : b; }
  static T rsqrt14(T x) {
    const uint32_t u = half::float_to_bits(x);
    const int32_t d = static_cast<int32_t>(u >> 23) - 127;
    const uint32_t m = u & 0x7fffffu, hb = static_cast<uint32_t>(d) & 1u;
    const int32_t q = (d - static_cast<int32_t>(hb)) / 2;
    if (m == 0 && hb == 0) return half::bits_to_float(static_cast<uint32_t>(127 - q) << 23);
    const uint32_t j = m >> 8, s = (hb << 5) | (j >> 10), t = j & 1023u;
    const uint32_t o =
        (static_cast<uint32_t>(kRsqrtC[s]) - static_cast<uint32_t>(kRsqrtD[s]) * t) >> 9;
    return half::bits_to_float((static_cast<uint32_t>(126 - q) << 23) | ((o - 65536u) << 7));
  }
  static T fix_specials(T x, T r) {
    if (!(x >= 0.f)) return half::bits_to_float(0x7fc00000u);
    if (x == 0.f || x == std::numeric_limits<float>::infinity()) return x;
    return r;
  }
};

#elif COMPCOMM_ADAM_ISA == 2

struct Avx2 {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const Bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static T load(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static void store(Bf16* p, T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i bias =
        _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // every lane is < 2^16, so the saturating pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static void store(F16* p, T x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Non-temporal stores to kWidth-element-aligned addresses.
  static void stream(float* p, T x) { _mm256_stream_ps(p, x); }
  static void stream(Bf16* p, T x) {
    alignas(16) Bf16 b[8];
    store(b, x);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static void stream(F16* p, T x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T neg(T a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static T less(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static bool all_normal(T a) {
    const T in = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(kSqrtTiny), _CMP_GE_OQ),
                               _mm256_cmp_ps(a, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ));
    return _mm256_movemask_ps(in) == 0xff;
  }
  static T select(T m, T a, T b) { return _mm256_blendv_ps(b, a, m); }
  static T rsqrt14(T x) {
    const __m256i u = _mm256_castps_si256(x), one = _mm256_set1_epi32(1);
    const __m256i d = _mm256_sub_epi32(_mm256_srli_epi32(u, 23), _mm256_set1_epi32(127));
    const __m256i m = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffff));
    const __m256i hb = _mm256_and_si256(d, one);
    const __m256i q = _mm256_srai_epi32(d, 1);  // floor(d / 2)
    const __m256i j = _mm256_srli_epi32(m, 8);
    const __m256i s = _mm256_or_si256(_mm256_slli_epi32(hb, 5), _mm256_srli_epi32(j, 10));
    const __m256i t = _mm256_and_si256(j, _mm256_set1_epi32(1023));
    const __m256i c = _mm256_i32gather_epi32(kRsqrtC, s, 4),
                  k = _mm256_i32gather_epi32(kRsqrtD, s, 4);
    const __m256i o = _mm256_srli_epi32(_mm256_sub_epi32(c, _mm256_mullo_epi32(k, t)), 9);
    const __m256i r =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(126), q), 23),
                        _mm256_slli_epi32(_mm256_sub_epi32(o, _mm256_set1_epi32(65536)), 7));
    const __m256i exact = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), q), 23);
    const __m256i pow4 = _mm256_cmpeq_epi32(_mm256_or_si256(m, hb), _mm256_setzero_si256());
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, exact, pow4));
  }
  static T fix_specials(T x, T r) {
    r = _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                         _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NGE_UQ));
    const T keep = _mm256_or_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ),
                                _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_inff()), _CMP_EQ_OQ));
    return _mm256_blendv_ps(r, x, keep);
  }
};

#elif COMPCOMM_ADAM_ISA == 3

struct Avx512 {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const Bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static T load(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static __m512i bf16_bits(T x) {  // round to nearest even, in the low 16 bits of each lane
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias =
        _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  }
  static void store(Bf16* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  static void store(F16* p, T x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Non-temporal stores to kWidth-element-aligned addresses.
  static void stream(float* p, T x) { _mm512_stream_ps(p, x); }
  static void stream(Bf16* p, T x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  static void stream(F16* p, T x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T neg(T a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static __mmask16 less(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static bool all_normal(T a) {
    return (_mm512_cmp_ps_mask(a, _mm512_set1_ps(kSqrtTiny), _CMP_GE_OQ) &
            _mm512_cmp_ps_mask(a, _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ)) == 0xffff;
  }
  static T select(__mmask16 m, T a, T b) { return _mm512_mask_blend_ps(m, b, a); }
  static T rsqrt14(T x) {
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    const __m512i d = _mm512_sub_epi32(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(127));
    const __m512i m = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffff));
    const __m512i hb = _mm512_and_si512(d, one);
    const __m512i q = _mm512_srai_epi32(d, 1);  // floor(d / 2)
    const __m512i j = _mm512_srli_epi32(m, 8);
    const __m512i s = _mm512_srli_epi32(j, 10);  // segment within the half
    const __m512i t = _mm512_and_si512(j, _mm512_set1_epi32(1023));
    // 64-entry lookups: two 32-entry permutes per table, chosen by the exponent's parity
    const __mmask16 odd = _mm512_test_epi32_mask(hb, one);
    const __m512i c = _mm512_mask_blend_epi32(
        odd,
        _mm512_permutex2var_epi32(_mm512_load_si512(kRsqrtC), s, _mm512_load_si512(kRsqrtC + 16)),
        _mm512_permutex2var_epi32(_mm512_load_si512(kRsqrtC + 32), s,
                                  _mm512_load_si512(kRsqrtC + 48)));
    const __m512i k = _mm512_mask_blend_epi32(
        odd,
        _mm512_permutex2var_epi32(_mm512_load_si512(kRsqrtD), s, _mm512_load_si512(kRsqrtD + 16)),
        _mm512_permutex2var_epi32(_mm512_load_si512(kRsqrtD + 32), s,
                                  _mm512_load_si512(kRsqrtD + 48)));
    const __m512i o = _mm512_srli_epi32(_mm512_sub_epi32(c, _mm512_mullo_epi32(k, t)), 9);
    const __m512i r =
        _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(126), q), 23),
                        _mm512_slli_epi32(_mm512_sub_epi32(o, _mm512_set1_epi32(65536)), 7));
    const __m512i exact = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), q), 23);
    const __mmask16 pow4 = _mm512_testn_epi32_mask(_mm512_or_si512(m, hb), _mm512_or_si512(m, hb));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(pow4, r, exact));
  }
  static T fix_specials(T x, T r) {
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NGE_UQ), r,
                             _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                           _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_inff()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(keep, r, x);
  }
};

// VRSQRT14PS itself: one instruction instead of the ~20 of the emulation, used where it gives the
// emulation's bits (rsqrt14_hw_matches: every Intel CPU checked so far does).
struct Avx512Hw : Avx512 {
  static T rsqrt14(T x) { return _mm512_rsqrt14_ps(x); }
};

// Compares the instruction with the emulation on every input prefix the emulation reads (both
// exponent parities x 2^15 fraction prefixes, each with the 8 ignored low bits all 0 and all 1), on
// powers of 4, and on every exponent the sqrt can feed it (2^-85 and up).
bool rsqrt14_hw_matches() {
  alignas(64) uint32_t in[16];
  int k = 0;
  bool same = true;
  auto check = [&](uint32_t u) {
    in[k++] = u;
    if (k == 16) {
      const __m512 x = _mm512_load_ps(reinterpret_cast<const float*>(in));
      same = same && _mm512_cmpneq_epi32_mask(_mm512_castps_si512(_mm512_rsqrt14_ps(x)),
                                              _mm512_castps_si512(Avx512::rsqrt14(x))) == 0;
      k = 0;
    }
  };
  for (uint32_t e = 127; e <= 128; ++e)
    for (uint32_t j = 0; j < 32768; ++j) {
      check((e << 23) | (j << 8));
      check((e << 23) | (j << 8) | 0xffu);
    }
  constexpr uint32_t kMantissas[5] = {0u, 1u, 0x2aaaaau, 0x555555u, 0x7fffffu};
  for (uint32_t e = 42; e <= 254; ++e)
    for (int i = 0; i < 5; ++i) check((e << 23) | kMantissas[i]);
  while (k != 0) check(127u << 23);
  return same;
}

#endif

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
