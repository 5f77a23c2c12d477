// CPU twins of the CUDA kernels: the fallback for host tensors and the oracle the GPU kernels are tested
// against. Each kernel works in blocks of 8 elements (one packed byte). A generic version runs anywhere;
// on x86-64 an AVX2 version of the hot loops is chosen at run time. Both give the same signs and the
// same fp32 values (the server sums run in the same rank order); fp64 norm sums may differ in their
// last bits between the two, which is within the fp32 rounding of the scales.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "half.h"
#include "kernels.h"
#include "notice.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COMPCOMM_X86 1
#include <immintrin.h>
#define COMPCOMM_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace compcomm::kernels::cpu {
namespace {

using half::bf16_to_float;
using half::float_to_bf16;
using half::float_to_half;
using half::half_to_float;

struct Tables {
  float half_to_float[65536];
  uint8_t reverse[256];  // bit-reversed byte: movemask order (LSB first) -> packed order (MSB first)
  float sign[256][8];    // sign[b][t] = +1 if bit 7-t of b is set, else -1
  // flip[b][t] = the fp32 sign bit where bit 7-t of b is clear, else 0: one load and one xor turn a
  // broadcast weight into +-weight per lane (the server loops' hot step)
  alignas(32) uint32_t flip[256][8];
  Tables() {
    for (uint32_t h = 0; h < 65536; ++h) half_to_float[h] = half::half_to_float(static_cast<uint16_t>(h));
    for (int b = 0; b < 256; ++b) {
      uint8_t r = 0;
      for (int t = 0; t < 8; ++t) {
        if (b & (1 << t)) r |= static_cast<uint8_t>(1 << (7 - t));
        sign[b][t] = (b >> (7 - t)) & 1 ? 1.0f : -1.0f;
        flip[b][t] = (b >> (7 - t)) & 1 ? 0u : 0x80000000u;
      }
      reverse[b] = r;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline float sgn(float v) { return v < 0.0f ? -1.0f : 1.0f; }

inline double sum8(const double* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline float norm_scale(double sumsq, int64_t count) {
  if (count == 0) return 0.0f;
  const float norm = static_cast<float>(std::sqrt(sumsq));
  return norm / static_cast<float>(std::sqrt(static_cast<double>(count)));
}

// ---- input types -------------------------------------------------------------------------------

struct F32 {
  using T = float;
  static float load(const void* p, int64_t k, const Tables&) { return static_cast<const float*>(p)[k]; }
#ifdef COMPCOMM_X86
  COMPCOMM_AVX2 static __m256 load8(const void* p, int64_t k) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + k);
  }
#endif
};
struct F16 {
  using T = uint16_t;
  static float load(const void* p, int64_t k, const Tables& t) {
    return t.half_to_float[static_cast<const uint16_t*>(p)[k]];
  }
  static uint16_t store_bits(float v) { return float_to_half(v); }
#ifdef COMPCOMM_X86
  COMPCOMM_AVX2 static __m256 load8(const void* p, int64_t k) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k)));
  }
#endif
};
struct BF16 {
  using T = uint16_t;
  static float load(const void* p, int64_t k, const Tables&) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[k]);
  }
  static uint16_t store_bits(float v) { return float_to_bf16(v); }
#ifdef COMPCOMM_X86
  COMPCOMM_AVX2 static __m256 load8(const void* p, int64_t k) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
};

// ---- generic building blocks --------------------------------------------------------------------

// x[0..8) = fl32(m + e) for elements k0..k0+7 (m = +0 past n).
template <class L>
inline void load_x8(const void* m, int64_t n, const float* e, int64_t k0, float* x, const Tables& t) {
  if (k0 + 8 <= n) {
    for (int i = 0; i < 8; ++i) x[i] = L::load(m, k0 + i, t) + e[k0 + i];
  } else {
    for (int i = 0; i < 8; ++i) x[i] = (k0 + i < n ? L::load(m, k0 + i, t) : 0.0f) + e[k0 + i];
  }
}

// Bit 7-i is set unless x[i] < 0 (so +0, -0 and NaN pack as +1).
inline uint8_t pack8(const float* x) {
  uint8_t b = 0;
  for (int i = 0; i < 8; ++i) b |= static_cast<uint8_t>(!(x[i] < 0.0f)) << (7 - i);
  return b;
}

// c[0..8) for packed byte b of the server chunk.
inline void server_c8(const uint8_t* signs, const float* scales, int64_t stride, int world,
                      const float* serr, int64_t chunk, int64_t b, float* c, const Tables& t) {
  const float inv_w = 1.0f / static_cast<float>(world);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < world; ++i) {
    const float a = scales[i * stride] * inv_w;
    const float* s = t.sign[signs[i * (chunk / 8) + b]];
    for (int j = 0; j < 8; ++j) acc[j] += a * s[j];
  }
  for (int j = 0; j < 8; ++j) c[j] = acc[j] + serr[8 * b + j];
}

// Generic worker pass 1 over blocks [b0, b1); adds to acc[8].
template <class L>
void worker_scale_pack_blocks(const void* m, int64_t n, const float* e, int64_t b0, int64_t b1,
                              double* acc, uint8_t* signs, const Tables& t) {
  float x[8];
  for (int64_t b = b0; b < b1; ++b) {
    load_x8<L>(m, n, e, 8 * b, x, t);
    for (int i = 0; i < 8; ++i) acc[i] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    signs[b] = pack8(x);
  }
}

// Generic commit of one block: error update and (for k < n) the output.
template <class L>
inline void update_decompress_block(void* m, int64_t n, float* e, int64_t k0, float sigma, float tau,
                                    uint8_t bits, const Tables& t) {
  float x[8];
  load_x8<L>(m, n, e, k0, x, t);
  for (int i = 0; i < 8; ++i) e[k0 + i] = x[i] - sigma * sgn(x[i]);
  const float* s = t.sign[bits];
  for (int i = 0; i < 8 && k0 + i < n; ++i) {
    if constexpr (std::is_same_v<L, F32>) {
      static_cast<float*>(m)[k0 + i] = tau * s[i];
    } else {
      static_cast<uint16_t*>(m)[k0 + i] = L::store_bits(tau * s[i]);
    }
  }
}

// ---- AVX2 versions of the hot loops ------------------------------------------------------------

#ifdef COMPCOMM_X86
// COMPCOMM_DISABLE_AVX2=1 forces the generic code (the tests compare the two).
bool have_avx2() {
  static const bool yes = std::getenv("COMPCOMM_DISABLE_AVX2") == nullptr &&
                          __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}

COMPCOMM_AVX2 inline double hsum(__m256d v) {
  alignas(32) double d[4];
  _mm256_store_pd(d, v);
  return (d[0] + d[1]) + (d[2] + d[3]);
}

COMPCOMM_AVX2 inline uint8_t pack8_avx2(__m256 x, const Tables& t) {
  const int neg = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  return t.reverse[~neg & 0xff];
}

// All-ones in lane i iff bit 7-i of `bits` is set.
COMPCOMM_AVX2 inline __m256 bit_lanes(uint8_t bits) {
  const __m256i sel = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), sel), sel));
}

// v - s * sign(v): s with its sign bit set where v < 0 (the product is exact, as in the generic code).
COMPCOMM_AVX2 inline __m256 minus_signed(__m256 v, __m256 s) {
  const __m256 lt = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_sub_ps(v, _mm256_or_ps(s, _mm256_and_ps(lt, _mm256_set1_ps(-0.0f))));
}

// Software prefetch kPrefetch elements ahead in m and e (one 64-byte line of e per call): one core
// of a VM pulls the two streams faster with it than with the hardware prefetcher alone. A hint, no
// effect on results.
constexpr int64_t kPrefetch = 2048;
template <class L>
inline void prefetch_ahead(const void* m, const float* e, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(e + k + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(static_cast<const typename L::T*>(m) + k + kPrefetch),
               _MM_HINT_T0);
}

template <class L>
COMPCOMM_AVX2 void worker_scale_pack_avx2(const void* m, int64_t n, const float* e, int64_t padded,
                                          float* scale, uint8_t* signs, const Tables& t) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  const int64_t full = n / 8;  // blocks entirely inside m
  for (int64_t b = 0; b < full; ++b) {
    if ((b & 1) == 0) prefetch_ahead<L>(m, e, 8 * b);
    const __m256 x = _mm256_add_ps(L::load8(m, 8 * b), _mm256_loadu_ps(e + 8 * b));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(lo, lo));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(hi, hi));
    signs[b] = pack8_avx2(x, t);
  }
  double tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  worker_scale_pack_blocks<L>(m, n, e, full, padded / 8, tail, signs, t);
  *scale = norm_scale(hsum(acc0) + hsum(acc1) + sum8(tail), padded);
}

template <class L>
COMPCOMM_AVX2 void update_decompress_avx2(void* m, int64_t n, float* e, int64_t padded, float sigma,
                                          const float* out_scales, int64_t oss, const uint8_t* out_signs,
                                          int64_t osb, int world, const Tables& t) {
  const int64_t chunk = padded / world;
  const __m256 sig = _mm256_set1_ps(sigma);
  for (int j = 0; j < world; ++j) {
    const float tau = out_scales[j * oss];
    const uint8_t* row = out_signs + j * osb;
    const __m256 pos = _mm256_set1_ps(tau), neg = _mm256_set1_ps(-tau);
    __m128i pos16 = _mm_setzero_si128(), neg16 = _mm_setzero_si128();
    if constexpr (!std::is_same_v<L, F32>) {
      pos16 = _mm_set1_epi16(static_cast<short>(L::store_bits(tau)));
      neg16 = _mm_set1_epi16(static_cast<short>(L::store_bits(-tau)));
    }
    for (int64_t b = 0; b < chunk / 8; ++b) {
      const int64_t k0 = j * chunk + 8 * b;
      if (k0 + 8 > n) {  // the block holding the end of m, and the padding
        update_decompress_block<L>(m, n, e, k0, sigma, tau, row[b], t);
        continue;
      }
      if ((b & 1) == 0) prefetch_ahead<L>(m, e, k0);
      const __m256 x = _mm256_add_ps(L::load8(m, k0), _mm256_loadu_ps(e + k0));
      _mm256_storeu_ps(e + k0, minus_signed(x, sig));
      const __m256 on = bit_lanes(row[b]);
      if constexpr (std::is_same_v<L, F32>) {
        _mm256_storeu_ps(static_cast<float*>(m) + k0, _mm256_blendv_ps(neg, pos, on));
      } else {
        const __m256i on32 = _mm256_castps_si256(on);
        const __m128i on16 = _mm_packs_epi32(_mm256_castsi256_si128(on32), _mm256_extracti128_si256(on32, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(m) + k0),
                         _mm_blendv_epi8(neg16, pos16, on16));
      }
    }
  }
}

// The per-rank weights fl32(scale_i * fl32(1/W)), computed once per kernel call (on the stack for up
// to kMaxCachedRanks ranks, else recomputed per block).
constexpr int kMaxCachedRanks = 256;

// c for byte b: the same sequential fp32 sum over ranks as server_c8.
COMPCOMM_AVX2 inline __m256 server_c8_avx2(const uint8_t* signs, const float* weights, const float* scales,
                                           int64_t stride, int world, const float* serr, int64_t chunk,
                                           int64_t b) {
  const float inv_w = 1.0f / static_cast<float>(world);
  const __m256 flip = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < world; ++i) {
    const __m256 a = _mm256_set1_ps(weights ? weights[i] : scales[i * stride] * inv_w);
    // +a where the bit is set, -a (sign bit flipped) where it is clear.
    const __m256 v = _mm256_xor_ps(a, _mm256_andnot_ps(bit_lanes(signs[i * (chunk / 8) + b]), flip));
    acc = _mm256_add_ps(acc, v);
  }
  return _mm256_add_ps(acc, _mm256_loadu_ps(serr + 8 * b));
}

inline const float* cache_weights(const float* scales, int64_t stride, int world, float* out) {
  if (world > kMaxCachedRanks) return nullptr;
  const float inv_w = 1.0f / static_cast<float>(world);
  for (int i = 0; i < world; ++i) out[i] = scales[i * stride] * inv_w;
  return out;
}

// c for the kServerBlocks bytes b0.. at once: the same per-element sum as server_c8_avx2 (+-weight
// added rank by rank in rank order from +0, then the server error), but with independent chains in
// flight and the lane signs from the flip table. One block at a time, each block waits on its chain
// of W dependent adds: a 2^22-element chunk at W = 4 took 5.9-6.3 ms per server pass on one core of
// the 2-core VM, 2.8-3.4 ms like this (bench/bench_cpu_phases.py).
constexpr int64_t kServerBlocks = 4;
COMPCOMM_AVX2 inline void server_c32_avx2(const uint8_t* signs, const float* weights, const float* scales,
                                          int64_t stride, int world, const float* serr, int64_t chunk,
                                          int64_t b0, __m256* c, const Tables& t) {
  const float inv_w = 1.0f / static_cast<float>(world);
  __m256 acc[kServerBlocks];
  for (int64_t u = 0; u < kServerBlocks; ++u) acc[u] = _mm256_setzero_ps();
  for (int i = 0; i < world; ++i) {
    const __m256 a = _mm256_set1_ps(weights ? weights[i] : scales[i * stride] * inv_w);
    const uint8_t* s = signs + i * (chunk / 8) + b0;
    for (int64_t u = 0; u < kServerBlocks; ++u)
      acc[u] = _mm256_add_ps(acc[u], _mm256_xor_ps(a, _mm256_load_ps(
                                                         reinterpret_cast<const float*>(t.flip[s[u]]))));
  }
  for (int64_t u = 0; u < kServerBlocks; ++u)
    c[u] = _mm256_add_ps(acc[u], _mm256_loadu_ps(serr + 8 * (b0 + u)));
}

// The norm's fp64 sums (in block order, as ever) and the packed signs of one block c.
COMPCOMM_AVX2 inline void server_norm_pack(__m256 c, __m256d& acc0, __m256d& acc1, uint8_t* packed,
                                           const Tables& t) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(c));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1));
  acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(lo, lo));
  acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(hi, hi));
  *packed = pack8_avx2(c, t);
}

COMPCOMM_AVX2 void server_scale_pack_avx2(const uint8_t* signs, const float* scales, int64_t stride,
                                          int world, const float* serr, int64_t chunk, float* scale,
                                          uint8_t* packed, const Tables& t) {
  float cache[kMaxCachedRanks];
  const float* w = cache_weights(scales, stride, world, cache);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  const int64_t blocks = chunk / 8;
  int64_t b = 0;
  for (; b + kServerBlocks <= blocks; b += kServerBlocks) {
    __m256 c[kServerBlocks];
    server_c32_avx2(signs, w, scales, stride, world, serr, chunk, b, c, t);
    for (int64_t u = 0; u < kServerBlocks; ++u) server_norm_pack(c[u], acc0, acc1, packed + b + u, t);
  }
  for (; b < blocks; ++b)
    server_norm_pack(server_c8_avx2(signs, w, scales, stride, world, serr, chunk, b), acc0, acc1,
                     packed + b, t);
  *scale = norm_scale(hsum(acc0) + hsum(acc1), chunk);
}

COMPCOMM_AVX2 void server_update_avx2(const uint8_t* signs, const float* scales, int64_t stride, int world,
                                      float* serr, int64_t chunk, float tau, const Tables& t) {
  float cache[kMaxCachedRanks];
  const float* w = cache_weights(scales, stride, world, cache);
  const __m256 ts = _mm256_set1_ps(tau);
  const int64_t blocks = chunk / 8;
  int64_t b = 0;
  for (; b + kServerBlocks <= blocks; b += kServerBlocks) {
    __m256 c[kServerBlocks];
    server_c32_avx2(signs, w, scales, stride, world, serr, chunk, b, c, t);
    for (int64_t u = 0; u < kServerBlocks; ++u)
      _mm256_storeu_ps(serr + 8 * (b + u), minus_signed(c[u], ts));
  }
  for (; b < blocks; ++b) {
    const __m256 c = server_c8_avx2(signs, w, scales, stride, world, serr, chunk, b);
    _mm256_storeu_ps(serr + 8 * b, minus_signed(c, ts));
  }
}
#endif  // COMPCOMM_X86

// ---- generic whole-kernel versions ----------------------------------------------------------------

template <class L>
void worker_scale_pack_impl(const void* m, int64_t n, const float* e, int64_t padded, float* scale,
                            uint8_t* signs) {
  const Tables& t = tables();
#ifdef COMPCOMM_X86
  if (have_avx2()) return worker_scale_pack_avx2<L>(m, n, e, padded, scale, signs, t);
#endif
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  worker_scale_pack_blocks<L>(m, n, e, 0, padded / 8, acc, signs, t);
  *scale = norm_scale(sum8(acc), padded);
}

template <class L>
void update_decompress_impl(void* m, int64_t n, float* e, int64_t padded, float sigma,
                            const float* out_scales, int64_t oss, const uint8_t* out_signs, int64_t osb,
                            int world) {
  const Tables& t = tables();
#ifdef COMPCOMM_X86
  if (have_avx2())
    return update_decompress_avx2<L>(m, n, e, padded, sigma, out_scales, oss, out_signs, osb, world, t);
#endif
  const int64_t chunk = padded / world;
  for (int j = 0; j < world; ++j)
    for (int64_t b = 0; b < chunk / 8; ++b)
      update_decompress_block<L>(m, n, e, j * chunk + 8 * b, sigma, out_scales[j * oss], out_signs[j * osb + b], t);
}

template <template <class> class F, class... Args>
Status dispatch(InputType dtype, Args... args) {
  switch (dtype) {
    case InputType::kFloat32: F<F32>::run(args...); return Status::kSuccess;
    case InputType::kFloat16: F<F16>::run(args...); return Status::kSuccess;
    case InputType::kBFloat16: F<BF16>::run(args...); return Status::kSuccess;
  }
  return Status::kInvalidArgument;
}

template <class L> struct WorkerScalePack { template <class... A> static void run(A... a) { worker_scale_pack_impl<L>(a...); } };
template <class L> struct UpdateDecompress { template <class... A> static void run(A... a) { update_decompress_impl<L>(a...); } };

bool bad_sizes(int64_t n, int64_t padded) { return n < 0 || padded < n || padded % 8 != 0; }

// True when a guard array is given and one of its `world` scales is not finite (see kernels.h).
bool guard_trips(const float* guard, int64_t stride, int world) {
  if (guard == nullptr) return false;
  for (int i = 0; i < world; ++i)
    if (!std::isfinite(guard[i * stride])) return true;
  return false;
}
bool bad_chunk(int world, int64_t chunk) { return world < 1 || chunk < 0 || chunk % 8 != 0; }

}  // namespace

size_t scale_workspace_bytes(int64_t) { return 0; }

Status worker_scale_pack(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                         float* scale, uint8_t* signs, void*, Stream) {
  if (bad_sizes(n, padded)) return Status::kInvalidArgument;
  return dispatch<WorkerScalePack>(dtype, m, n, error, padded, scale, signs);
}

Status server_scale_pack(const uint8_t* signs, const float* scales, int64_t stride, int world,
                         const float* server_error, int64_t chunk, float* scale, uint8_t* packed, void*,
                         Stream) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  const Tables& t = tables();
#ifdef COMPCOMM_X86
  if (have_avx2()) {
    server_scale_pack_avx2(signs, scales, stride, world, server_error, chunk, scale, packed, t);
    return Status::kSuccess;
  }
#endif
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float c[8];
  for (int64_t b = 0; b < chunk / 8; ++b) {
    server_c8(signs, scales, stride, world, server_error, chunk, b, c, t);
    for (int i = 0; i < 8; ++i) acc[i] += static_cast<double>(c[i]) * static_cast<double>(c[i]);
    packed[b] = pack8(c);
  }
  *scale = norm_scale(sum8(acc), chunk);
  return Status::kSuccess;
}

Status server_update(const uint8_t* signs, const float* scales, int64_t stride, int world,
                     float* server_error, int64_t chunk, const float* scale, Stream, const float* guard,
                     int64_t guard_stride) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  if (guard_trips(guard, guard_stride, world)) return Status::kSuccess;
#ifdef COMPCOMM_X86
  if (have_avx2()) {
    server_update_avx2(signs, scales, stride, world, server_error, chunk, *scale, tables());
    return Status::kSuccess;
  }
#endif
  const Tables& t = tables();
  const float tau = *scale;
  float c[8];
  for (int64_t b = 0; b < chunk / 8; ++b) {
    server_c8(signs, scales, stride, world, server_error, chunk, b, c, t);
    for (int i = 0; i < 8; ++i) server_error[8 * b + i] = c[i] - tau * sgn(c[i]);
  }
  return Status::kSuccess;
}

Status worker_update_decompress(void* m, InputType dtype, int64_t n, float* error, int64_t padded,
                                const float* scale, const float* out_scales, int64_t out_scale_stride,
                                const uint8_t* out_signs, int64_t out_sign_stride, int world, Stream,
                                const float* guard, int64_t guard_stride) {
  if (bad_sizes(n, padded) || world < 1 || padded % (8 * world) != 0) return Status::kInvalidArgument;
  if (guard_trips(guard, guard_stride, world)) return Status::kSuccess;
  return dispatch<UpdateDecompress>(dtype, m, n, error, padded, *scale, out_scales, out_scale_stride,
                                    out_signs, out_sign_stride, world);
}

Status write_header(ExchangeHeader* h, int64_t numel, int64_t padded, int32_t dtype, uint32_t magic,
                    Stream) {
  h->flags = std::isfinite(h->scale) ? 0u : 1u;
  h->numel = numel;
  h->padded = padded;
  h->dtype = dtype;
  h->magic = magic;
  return Status::kSuccess;
}

Status decompress(const float* scale, const uint8_t* packed, int64_t count, float* out, Stream,
                  const float* guard, int64_t guard_stride, int guard_count) {
  if (count < 0 || (guard != nullptr && guard_count < 1)) return Status::kInvalidArgument;
  if (guard_trips(guard, guard_stride, guard_count)) return Status::kSuccess;
  const float t = *scale;
  for (int64_t i = 0; i < count; ++i) out[i] = (packed[i >> 3] >> (7 - (i & 7))) & 1 ? t : -t;
  return Status::kSuccess;
}

Status worker_scale_pack_header(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                                ExchangeHeader* header, int32_t header_dtype, uint32_t magic, uint8_t* signs,
                                void* workspace, Stream stream, HeaderNotice* notice, uint64_t seq) {
  if (header == nullptr) return Status::kInvalidArgument;  // as the device twin
  Status s = worker_scale_pack(m, dtype, n, error, padded, &header->scale, signs, workspace, stream);
  if (s == Status::kSuccess) s = write_header(header, n, padded, header_dtype, magic, stream);
  if (s != Status::kSuccess || notice == nullptr) return s;
  post_notice_host(notice, *header, seq);  // as the device twin
  return s;
}

Status commit(const uint8_t* signs, const float* scales, int64_t scale_stride, float* server_error,
              const float* server_scale, void* m, InputType dtype, int64_t n, float* error, int64_t padded,
              const float* scale, const float* out_scales, int64_t out_scale_stride, const uint8_t* out_signs,
              int64_t out_sign_stride, int world, Stream stream, const float* guard, int64_t guard_stride) {
  // Validated and guarded before either write, so that both happen or neither does.
  if (bad_sizes(n, padded) || world < 1 || padded % (8 * world) != 0) return Status::kInvalidArgument;
  if (padded == 0) return Status::kSuccess;  // nothing to write (as the device twin: no read either)
  if (guard_trips(guard, guard_stride, world)) return Status::kSuccess;
  const Status s = server_update(signs, scales, scale_stride, world, server_error, padded / world, server_scale,
                                 stream);
  if (s != Status::kSuccess) return s;
  return worker_update_decompress(m, dtype, n, error, padded, scale, out_scales, out_scale_stride, out_signs,
                                  out_sign_stride, world, stream);
}

Status commit_gate(const int* abort_flag, float* scales, int64_t stride, int world, Stream) {
  if (abort_flag == nullptr || scales == nullptr || world < 0) return Status::kInvalidArgument;
  // Read once, like the device twin: a concurrent setter may be another thread.
  if (*static_cast<const volatile int*>(abort_flag) == 0) return Status::kSuccess;
  for (int i = 0; i < world; ++i) scales[i * stride] = std::numeric_limits<float>::quiet_NaN();
  return Status::kSuccess;
}

}  // namespace compcomm::kernels::cpu
