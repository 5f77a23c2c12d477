// The vector types of the CPU optimizer kernels (cpu_adam.cpp, cpu_lamb.cpp): one struct per instruction
// set with the same operations, so that a loop body written once as a template over V is the same
// sequence of IEEE fp32 operations on every path (see cpu_adam.h for the numerics, including the
// rsqrt14 square root that reproduces torch's MKL sqrt on AVX-512 CPUs).
//
// Included by a source file that is compiled once per instruction set (COMPCOMM_ADAM_ISA unset: the
// generic scalar path; 2: AVX2; 3: AVX-512). Everything here has internal linkage, so no vector code
// can leak into another object's path through a shared inline definition.
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(COMPCOMM_ADAM_ISA)
#include <cmath>
#include <limits>

#include "half.h"
#else
#include <immintrin.h>
#endif

namespace compcomm::kernels::cpu {
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

// ------------------------------------------------------------------------------------------------
// The vector types. Each provides T, kWidth, set1, load/store for float, Bf16 and F16, and the
// correctly rounded add, sub, mul, div, sqrt and fma; max_nan, and Sums / add_squares / store_sums
// (fp64 sums of squares in eight partial sums, element k into sum k % 8, the same on every path). bf16 stores
// round to nearest even, as torch's conversion does for numbers; a NaN becomes (bits >> 16) | 0x40, the
// quiet NaN with its sign and top 7 mantissa bits (not as torch: its conversion gives 0xffff, or 0x7fc0
// on its scalar path, for every NaN). fp16 stores convert as F16C's vcvtps2ph (and torch): a NaN keeps
// its sign and top 10 mantissa bits, quiet bit set (half.h). Both give the same bits on every path.
// For the rsqrt14 sqrt: all_normal
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
  // a if a > b or a is NaN, else b: a running max that keeps the first NaN (torch's max does)
  static T max_nan(T a, T b) { return (a > b || a != a) ? a : b; }
  // fp64 sums of squares, element k into sums[k % 8] (the vector types' lane order)
  struct Sums {
    double s[8] = {};
  };
  static void add_squares(Sums& acc, T x, int64_t k) {
    const double d = x;
    acc.s[k & 7] += d * d;
  }
  static void store_sums(double* out, const Sums& acc) { std::memcpy(out, acc.s, sizeof(acc.s)); }
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
  static T max_nan(T a, T b) {
    const T take_a = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    return _mm256_blendv_ps(b, a, take_a);
  }
  struct Sums {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  };
  static void add_squares(Sums& acc, T x, int64_t) {  // a float's square is exact in fp64
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                  b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc.lo = _mm256_add_pd(acc.lo, _mm256_mul_pd(a, a));
    acc.hi = _mm256_add_pd(acc.hi, _mm256_mul_pd(b, b));
  }
  static void store_sums(double* out, const Sums& acc) {
    _mm256_storeu_pd(out, acc.lo);
    _mm256_storeu_pd(out + 4, acc.hi);
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
  static T max_nan(T a, T b) {
    const __mmask16 take_a = _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(take_a, b, a);
  }
  struct Sums {
    __m512d s = _mm512_setzero_pd();
  };
  static void add_squares(Sums& acc, T x, int64_t) {  // lanes 0-7, then 8-15: element order
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                  b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc.s = _mm512_add_pd(acc.s, _mm512_mul_pd(a, a));
    acc.s = _mm512_add_pd(acc.s, _mm512_mul_pd(b, b));
  }
  static void store_sums(double* out, const Sums& acc) { _mm512_storeu_pd(out, acc.s); }
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
}  // namespace compcomm::kernels::cpu
