// 1-bit LAMB's CPU passes (see cpu_lamb.h for the per-element numerics). Built as cpu_adam.cpp is:
// compiled once without COMPCOMM_ADAM_ISA (the entry points, the thread split and the generic
// loops) and, on x86-64, once each for AVX2 and AVX-512; the loop bodies are templates over the
// vector types of cpu_vec.h, so every path is the same sequence of operations. A partial vector at
// the end of a range runs through zero-padded stack buffers, its padding lanes left out of the max
// and the sums.
#include "cpu_lamb.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_vec.h"

#if !defined(COMPCOMM_ADAM_ISA)
#include <algorithm>
#include <thread>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#endif

namespace compcomm::kernels::cpu {

// One block's max ratio and sums (added to the others in block order by the entry point).
struct LambPartial {
  float max_ratio;
  double u_sq, update_sq;
};

namespace detail {
// The range functions of one instruction set (the AVX2 / AVX-512 objects define theirs).
struct LambFns {
  void (*momentum)(const LambCoeffs&, float, float*, const float*, float*, int64_t, int64_t);
  LambPartial (*stats)(const LambCoeffs&, float, const LambTensors&, int64_t, int64_t);
  void (*apply)(const LambCoeffs&, float, const LambTensors&, int64_t, int64_t);
};
LambFns lamb_fns_avx2();
LambFns lamb_fns_avx512();
}  // namespace detail

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Software prefetch distance of the statistics pass, in elements (as cpu_adam.cpp's).
constexpr int64_t kPrefetch = 256;

// NaN-keeping max of two floats (as V::max_nan)
inline float max_nan1(float a, float b) { return (a > b || a != a) ? a : b; }

template <class V>
struct LambBody {
  using T = typename V::T;
  T b1, c1, b2, c2, eps, bc2, bc1, wd, scale;
  bool unscale, div_bc1, div_bc2, bias_correction, weight_decay, v_is_sqrt, ieee;

  LambBody(const LambCoeffs& c, float s)
      : b1(V::set1(c.b1)),
        c1(V::set1(c.c1)),
        b2(V::set1(c.b2)),
        c2(V::set1(c.c2)),
        eps(V::set1(c.eps)),
        bc2(V::set1(c.bc2)),
        bc1(V::set1(c.bc1)),
        wd(V::set1(c.wd)),
        scale(V::set1(s)),
        unscale(s != 1.f),
        div_bc1(c.bias_correction && c.bc1 != 1.f),
        div_bc2(c.bias_correction && c.bc2 != 1.f),
        bias_correction(c.bias_correction),
        weight_decay(c.weight_decay),
        v_is_sqrt(c.v_is_sqrt),
        ieee(c.sqrt == SqrtMode::kIeee) {}

  T root(T v) const { return v_is_sqrt ? v : sqrt_of<V>(v, ieee); }

  // The direction from the unscaled momentum, sqrt(v) and w: u (out) and u + w * wd (returned).
  T update(T m, T s, T w, T* u_out) const {
    T u;
    if (bias_correction) {
      u = V::div(m, V::add(div_bc2 ? V::div(s, bc2) : s, eps));
      if (div_bc1) u = V::div(u, bc1);
    } else {
      u = V::div(m, V::add(s, eps));
    }
    *u_out = u;
    return weight_decay ? V::add(u, V::mul(w, wd)) : u;
  }

  // One vector of lamb_stats: writes m (unscaled) and vf; ratio, u and the update out. With g,
  // the momentum is updated first (last: the old m).
  void stats(float* m, const float* last, const float* g, const float* v, float* vf,
             const float* w, T* ratio, T* u, T* upd) const {
    T mv = V::load(m), lv;
    if (g) {
      lv = mv;
      mv = V::fma(V::load(g), c1, V::mul(mv, b1));
      if (unscale) mv = V::div(V::mul(mv, scale), scale);
      V::store(m, mv);
    } else {
      lv = V::load(last);
      if (unscale) {
        mv = V::div(mv, scale);
        V::store(m, mv);
      }
    }
    const T gh = V::div(V::sub(mv, V::mul(lv, b1)), c1);
    const T f = V::fma(V::mul(c2, gh), gh, V::mul(V::load(vf), b2));
    V::store(vf, f);
    const T s = root(V::load(v));
    *ratio = V::div(V::add(s, eps), V::add(sqrt_of<V>(f, ieee), eps));
    *upd = update(mv, s, V::load(w), u);
  }
};

template <class V>
void momentum_range(const LambCoeffs& c, float scale, float* m, const float* g, float* last,
                    int64_t begin, int64_t end) {
  constexpr int64_t W = V::kWidth;
  const typename V::T b1 = V::set1(c.b1), c1 = V::set1(c.c1), sc = V::set1(scale);
  const bool rescale = scale != 1.f;
  auto one = [&](float* mp, const float* gp, float* lp) {
    auto x = V::load(mp);
    V::store(lp, x);
    x = V::fma(V::load(gp), c1, V::mul(x, b1));
    V::store(mp, rescale ? V::mul(x, sc) : x);
  };
  int64_t i = begin;
  for (; i + W <= end; i += W) one(m + i, g + i, last + i);
  if (const int64_t r = end - i; W > 1 && r > 0) {
    float mb[W] = {}, gb[W] = {}, lb[W] = {};
    std::memcpy(mb, m + i, r * sizeof(float));
    std::memcpy(gb, g + i, r * sizeof(float));
    one(mb, gb, lb);
    std::memcpy(m + i, mb, r * sizeof(float));
    std::memcpy(last + i, lb, r * sizeof(float));
  }
}

template <class V>
LambPartial stats_range(const LambCoeffs& c, float scale, const LambTensors& t, int64_t begin,
                        int64_t end) {
  using T = typename V::T;
  constexpr int64_t W = V::kWidth;
  const LambBody<V> body(c, scale);
  T mx = V::set1(kNegInf);
  typename V::Sums su, sd;
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    if (W > 1 && i + kPrefetch < end) {  // the streams read, ahead (a hint: no effect on results)
      __builtin_prefetch(t.m + i + kPrefetch, 1);
      __builtin_prefetch((t.g ? t.g : t.last) + i + kPrefetch, 0);
      __builtin_prefetch(t.v + i + kPrefetch, 0);
      __builtin_prefetch(t.vf + i + kPrefetch, 1);
      __builtin_prefetch(t.w + i + kPrefetch, 0);
    }
    T r, u, d;
    body.stats(t.m + i, t.g ? nullptr : t.last + i, t.g ? t.g + i : nullptr, t.v + i, t.vf + i,
               t.w + i, &r, &u, &d);
    mx = V::max_nan(r, mx);
    V::add_squares(su, u, i);
    if (c.weight_decay) V::add_squares(sd, d, i);
  }
  if (const int64_t r = end - i; W > 1 && r > 0) {
    float mb[W] = {}, lb[W] = {}, vb[W] = {}, fb[W] = {}, wb[W] = {};
    std::memcpy(mb, t.m + i, r * sizeof(float));
    std::memcpy(lb, t.g ? t.g + i : t.last + i, r * sizeof(float));  // g, or last
    std::memcpy(vb, t.v + i, r * sizeof(float));
    std::memcpy(fb, t.vf + i, r * sizeof(float));
    std::memcpy(wb, t.w + i, r * sizeof(float));
    T rv, u, d;
    body.stats(mb, t.g ? nullptr : lb, t.g ? lb : nullptr, vb, fb, wb, &rv, &u, &d);
    std::memcpy(t.m + i, mb, r * sizeof(float));
    std::memcpy(t.vf + i, fb, r * sizeof(float));
    float rb[W], ub[W], db[W];  // the padding lanes: out of the max and the sums
    V::store(rb, rv);
    V::store(ub, u);
    V::store(db, d);
    for (int64_t k = r; k < W; ++k) rb[k] = kNegInf, ub[k] = 0.f, db[k] = 0.f;
    mx = V::max_nan(V::load(rb), mx);
    V::add_squares(su, V::load(ub), i);
    if (c.weight_decay) V::add_squares(sd, V::load(db), i);
  }
  float lanes[W];
  V::store(lanes, mx);
  LambPartial out{kNegInf, 0.0, 0.0};
  for (int64_t k = 0; k < W; ++k) out.max_ratio = max_nan1(lanes[k], out.max_ratio);
  double s[8];
  V::store_sums(s, su);
  for (double x : s) out.u_sq += x;
  if (c.weight_decay) {
    V::store_sums(s, sd);
    for (double x : s) out.update_sq += x;
  } else {
    out.update_sq = out.u_sq;
  }
  return out;
}

template <class V>
void apply_range(const LambCoeffs& c, float neg_step, const LambTensors& t, int64_t begin,
                 int64_t end) {
  using T = typename V::T;
  constexpr int64_t W = V::kWidth;
  const LambBody<V> body(c, 1.f);
  const T ns = V::set1(neg_step);
  auto one = [&](const float* mp, const float* vp, float* wp) {
    T u;
    const T w = V::load(wp);
    V::store(wp, V::add(w, V::mul(body.update(V::load(mp), body.root(V::load(vp)), w, &u), ns)));
  };
  int64_t i = begin;
  for (; i + W <= end; i += W) one(t.m + i, t.v + i, t.w + i);
  if (const int64_t r = end - i; W > 1 && r > 0) {
    float mb[W] = {}, vb[W] = {}, wb[W] = {};
    std::memcpy(mb, t.m + i, r * sizeof(float));
    std::memcpy(vb, t.v + i, r * sizeof(float));
    std::memcpy(wb, t.w + i, r * sizeof(float));
    one(mb, vb, wb);
    std::memcpy(t.w + i, wb, r * sizeof(float));
  }
}

template <class V>
detail::LambFns fns() {
  return {&momentum_range<V>, &stats_range<V>, &apply_range<V>};
}

}  // namespace

#if defined(COMPCOMM_ADAM_ISA) && COMPCOMM_ADAM_ISA == 2
detail::LambFns detail::lamb_fns_avx2() { return fns<Avx2>(); }
#elif defined(COMPCOMM_ADAM_ISA) && COMPCOMM_ADAM_ISA == 3
detail::LambFns detail::lamb_fns_avx512() {
  static const bool hw = rsqrt14_hw_matches();
  return hw ? fns<Avx512Hw>() : fns<Avx512>();
}
#else
// ------------------------------------------------------------------------------------------------
// Entry points (generic object only).
// ------------------------------------------------------------------------------------------------
namespace {

bool pick(AdamIsa isa, detail::LambFns* out) {
  if (isa == AdamIsa::kAuto) isa = adam_best_isa();
  if (!adam_isa_supported(isa)) return false;
  *out = fns<Scalar>();
#if defined(COMPCOMM_ADAM_X86)
  if (isa == AdamIsa::kAvx512) *out = detail::lamb_fns_avx512();
  if (isa == AdamIsa::kAvx2) *out = detail::lamb_fns_avx2();
#endif
  return true;
}

int default_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

// f(0) ... f(tasks - 1) on up to num_threads threads (<= 0: the default).
template <class F>
void parallel(int64_t tasks, int num_threads, const F& f) {
  const int64_t nt = std::min<int64_t>(tasks, num_threads > 0 ? num_threads : default_threads());
  if (nt <= 1) {
    for (int64_t i = 0; i < tasks; ++i) f(i);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(static_cast<int>(nt)) schedule(static)
  for (int64_t i = 0; i < tasks; ++i) f(i);
#else
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < nt; ++k)
    pool.emplace_back([&f, k, nt, tasks] {
      for (int64_t i = k; i < tasks; i += nt) f(i);
    });
  for (int64_t i = 0; i < tasks; i += nt) f(i);
  for (auto& th : pool) th.join();
#endif
}

// An elementwise pass f(begin, end) over n elements: one piece per thread, pieces of at least
// 32K elements (waking threads costs more below) and multiples of 64.
template <class F>
void elementwise(int64_t n, int num_threads, const F& f) {
  constexpr int64_t kGrain = 32768;
  const int64_t nt = num_threads > 0 ? num_threads : default_threads();
  const int64_t chunk = std::max<int64_t>(kGrain, ((n + nt - 1) / nt + 63) / 64 * 64);
  parallel((n + chunk - 1) / chunk, num_threads,
           [&](int64_t k) { f(k * chunk, std::min(n, (k + 1) * chunk)); });
}

}  // namespace

Status lamb_momentum(const LambCoeffs& c, float scale, float* m, const float* g, float* last,
                     int64_t n, int num_threads, AdamIsa isa) {
  detail::LambFns f;
  if (n < 0 || (n > 0 && (!m || !g || !last)) || !pick(isa, &f)) return Status::kInvalidArgument;
  elementwise(n, num_threads,
              [&](int64_t b, int64_t e) { f.momentum(c, scale, m, g, last, b, e); });
  return Status::kSuccess;
}

Status lamb_stats(const LambCoeffs& c, float scale, const LambTensors& t, int64_t n, LambStats* out,
                  int num_threads, AdamIsa isa) {
  detail::LambFns f;
  if (n < 0 || !out || (n > 0 && (!t.m || !(t.last || t.g) || !t.v || !t.vf || !t.w)) ||
      !pick(isa, &f))
    return Status::kInvalidArgument;
  // blocks that depend on n only (at most kMaxBlocks, multiples of 64), their results added in
  // block order: the same sums whatever the thread count
  constexpr int64_t kBlock = 65536, kMaxBlocks = 256;
  const int64_t block = std::max(kBlock, ((n + kMaxBlocks - 1) / kMaxBlocks + 63) / 64 * 64);
  const int64_t blocks = (n + block - 1) / block;
  LambPartial parts[kMaxBlocks];
  parallel(blocks, num_threads, [&](int64_t k) {
    parts[k] = f.stats(c, scale, t, k * block, std::min(n, (k + 1) * block));
  });
  LambStats s;
  s.max_ratio = kNegInf;
  for (int64_t k = 0; k < blocks; ++k) {
    s.max_ratio = max_nan1(parts[k].max_ratio, s.max_ratio);
    s.u_sq += parts[k].u_sq;
    s.update_sq += parts[k].update_sq;
  }
  *out = s;
  return Status::kSuccess;
}

Status lamb_apply(const LambCoeffs& c, float neg_step, const LambTensors& t, int64_t n,
                  int num_threads, AdamIsa isa) {
  detail::LambFns f;
  if (n < 0 || (n > 0 && (!t.m || !t.v || !t.w)) || !pick(isa, &f)) return Status::kInvalidArgument;
  elementwise(n, num_threads, [&](int64_t b, int64_t e) { f.apply(c, neg_step, t, b, e); });
  return Status::kSuccess;
}

#endif  // entry points

}  // namespace compcomm::kernels::cpu
