// CPU twins of the CUDA kernels: the fallback for host tensors and the oracle the GPU kernels are tested
// against. Work is done in blocks of 8 elements (one packed byte) with fixed-length inner loops that the
// compiler vectorizes; the sign pack uses SSE compare + movemask where available.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace compcomm::kernels::cpu {
namespace {

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32.
    float v = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's .half() does.
uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {                                              // half subnormal or zero
    float a;
    std::memcpy(&a, &absx, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t mant = absx & 0x7fffffu;
  uint32_t h = ((((absx >> 23) - 127u + 15u)) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

uint16_t float_to_bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

struct Tables {
  float half_to_float[65536];
  uint8_t reverse[256];  // bit-reversed byte
  float sign[256][8];    // sign[b][t] = +1 if bit 7-t of b is set, else -1
  Tables() {
    for (uint32_t h = 0; h < 65536; ++h) half_to_float[h] = half_bits_to_float(static_cast<uint16_t>(h));
    for (int b = 0; b < 256; ++b) {
      uint8_t r = 0;
      for (int t = 0; t < 8; ++t) {
        if (b & (1 << t)) r |= static_cast<uint8_t>(1 << (7 - t));
        sign[b][t] = (b >> (7 - t)) & 1 ? 1.0f : -1.0f;
      }
      reverse[b] = r;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

struct F32 {
  static float load(const void* p, int64_t k, const Tables&) { return static_cast<const float*>(p)[k]; }
};
struct F16 {
  static float load(const void* p, int64_t k, const Tables& t) {
    return t.half_to_float[static_cast<const uint16_t*>(p)[k]];
  }
};
struct BF16 {
  static float load(const void* p, int64_t k, const Tables&) {
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[k]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

// Bit 7-t of the result is set unless x[t] < 0 (so +0, -0 and NaN pack as +1).
inline uint8_t pack8(const float* x, const Tables& t) {
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  const int neg = _mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(x), zero)) |
                  (_mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(x + 4), zero)) << 4);
  return t.reverse[~neg & 0xff];
#else
  (void)t;
  uint8_t b = 0;
  for (int i = 0; i < 8; ++i) b |= static_cast<uint8_t>(!(x[i] < 0.0f)) << (7 - i);
  return b;
#endif
}

inline float sgn(float v) { return v < 0.0f ? -1.0f : 1.0f; }

// x[0..8) = fl32(m + e) for elements k0..k0+7 (m = +0 past n).
template <class L>
inline void load_x8(const void* m, int64_t n, const float* e, int64_t k0, float* x, const Tables& t) {
  if (k0 + 8 <= n) {
    for (int i = 0; i < 8; ++i) x[i] = L::load(m, k0 + i, t) + e[k0 + i];
  } else {
    for (int i = 0; i < 8; ++i) x[i] = (k0 + i < n ? L::load(m, k0 + i, t) : 0.0f) + e[k0 + i];
  }
}

inline double sum8(const double* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline float norm_scale(double sumsq, int64_t count) {
  if (count == 0) return 0.0f;
  const float norm = static_cast<float>(std::sqrt(sumsq));
  return norm / static_cast<float>(std::sqrt(static_cast<double>(count)));
}

template <class L>
void worker_scale_impl(const void* m, int64_t n, const float* e, int64_t padded, float* scale) {
  const Tables& t = tables();
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float x[8];
  for (int64_t k0 = 0; k0 < padded; k0 += 8) {
    load_x8<L>(m, n, e, k0, x, t);
    for (int i = 0; i < 8; ++i) acc[i] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  }
  *scale = norm_scale(sum8(acc), padded);
}

template <class L>
void worker_pack_impl(const void* m, int64_t n, const float* e, int64_t padded, uint8_t* signs) {
  const Tables& t = tables();
  float x[8];
  for (int64_t k0 = 0; k0 < padded; k0 += 8) {
    load_x8<L>(m, n, e, k0, x, t);
    signs[k0 / 8] = pack8(x, t);
  }
}

// c[0..8) for packed byte b of the server chunk.
inline void server_c8(const uint8_t* signs, const float* scales, int64_t stride, int world,
                      const float* serr, int64_t chunk, int64_t b, float* c, const Tables& t) {
  const float inv_w = 1.0f / static_cast<float>(world);
  const int64_t row = chunk / 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < world; ++i) {
    const float a = scales[i * stride] * inv_w;
    const float* s = t.sign[signs[i * row + b]];
    for (int j = 0; j < 8; ++j) acc[j] += a * s[j];
  }
  for (int j = 0; j < 8; ++j) c[j] = acc[j] + serr[8 * b + j];
}

template <class L>
void update_decompress_impl(void* m, int64_t n, float* e, int64_t padded, float scale,
                            const float* out_scales, int64_t oss, const uint8_t* out_signs,
                            int64_t osb, int world) {
  const Tables& t = tables();
  const int64_t chunk = padded / world;
  float x[8];
  for (int j = 0; j < world; ++j) {
    const float tau = out_scales[j * oss];
    const uint8_t* row = out_signs + j * osb;
    for (int64_t b = 0; b < chunk / 8; ++b) {
      const int64_t k0 = j * chunk + 8 * b;
      load_x8<L>(m, n, e, k0, x, t);
      for (int i = 0; i < 8; ++i) e[k0 + i] = x[i] - scale * sgn(x[i]);
      const float* s = t.sign[row[b]];
      const int lim = k0 + 8 <= n ? 8 : (k0 < n ? static_cast<int>(n - k0) : 0);
      if constexpr (std::is_same_v<L, F32>) {
        float* out = static_cast<float*>(m) + k0;
        for (int i = 0; i < lim; ++i) out[i] = tau * s[i];
      } else {
        uint16_t* out = static_cast<uint16_t*>(m) + k0;
        const uint16_t pos = std::is_same_v<L, F16> ? float_to_half_bits(tau) : float_to_bf16_bits(tau);
        const uint16_t neg = std::is_same_v<L, F16> ? float_to_half_bits(-tau) : float_to_bf16_bits(-tau);
        for (int i = 0; i < lim; ++i) out[i] = s[i] > 0.0f ? pos : neg;
      }
    }
  }
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

template <class L> struct WorkerScale { template <class... A> static void run(A... a) { worker_scale_impl<L>(a...); } };
template <class L> struct WorkerPack { template <class... A> static void run(A... a) { worker_pack_impl<L>(a...); } };
template <class L> struct UpdateDecompress { template <class... A> static void run(A... a) { update_decompress_impl<L>(a...); } };

bool bad_sizes(int64_t n, int64_t padded) { return n < 0 || padded < n || padded % 8 != 0; }
bool bad_chunk(int world, int64_t chunk) { return world < 1 || chunk < 0 || chunk % 8 != 0; }

bool guard_trips(const float* guard, int64_t stride, int world) {
  if (guard == nullptr) return false;
  for (int i = 0; i < world; ++i)
    if (!std::isfinite(guard[i * stride])) return true;
  return false;
}

}  // namespace

size_t scale_workspace_bytes(int64_t) { return 0; }

Status worker_scale(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                    float* scale, void*, Stream) {
  if (bad_sizes(n, padded)) return Status::kInvalidArgument;
  return dispatch<WorkerScale>(dtype, m, n, error, padded, scale);
}

Status worker_pack(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                   uint8_t* signs, Stream) {
  if (bad_sizes(n, padded)) return Status::kInvalidArgument;
  return dispatch<WorkerPack>(dtype, m, n, error, padded, signs);
}

Status server_scale(const uint8_t* signs, const float* scales, int64_t stride, int world,
                    const float* server_error, int64_t chunk, float* scale, void*, Stream) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  const Tables& t = tables();
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float c[8];
  for (int64_t b = 0; b < chunk / 8; ++b) {
    server_c8(signs, scales, stride, world, server_error, chunk, b, c, t);
    for (int i = 0; i < 8; ++i) acc[i] += static_cast<double>(c[i]) * static_cast<double>(c[i]);
  }
  *scale = norm_scale(sum8(acc), chunk);
  return Status::kSuccess;
}

Status server_pack(const uint8_t* signs, const float* scales, int64_t stride, int world,
                   const float* server_error, int64_t chunk, uint8_t* packed, Stream) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  const Tables& t = tables();
  float c[8];
  for (int64_t b = 0; b < chunk / 8; ++b) {
    server_c8(signs, scales, stride, world, server_error, chunk, b, c, t);
    packed[b] = pack8(c, t);
  }
  return Status::kSuccess;
}

Status server_update(const uint8_t* signs, const float* scales, int64_t stride, int world,
                     float* server_error, int64_t chunk, const float* scale, Stream, const float* guard,
                     int64_t guard_stride) {
  if (bad_chunk(world, chunk)) return Status::kInvalidArgument;
  if (guard_trips(guard, guard_stride, world)) return Status::kSuccess;
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

// The fused entry points exist for the GPU, where a pass over memory is the cost; on the CPU they are
// the two passes in sequence (same results by construction).
Status worker_scale_pack(const void* m, InputType dtype, int64_t n, const float* error, int64_t padded,
                         float* scale, uint8_t* signs, void* workspace, Stream stream) {
  const Status s = worker_scale(m, dtype, n, error, padded, scale, workspace, stream);
  return s != Status::kSuccess ? s : worker_pack(m, dtype, n, error, padded, signs, stream);
}

Status server_scale_pack(const uint8_t* signs, const float* scales, int64_t stride, int world,
                         const float* server_error, int64_t chunk, float* scale, uint8_t* packed,
                         void* workspace, Stream stream) {
  const Status s = server_scale(signs, scales, stride, world, server_error, chunk, scale, workspace, stream);
  return s != Status::kSuccess ? s : server_pack(signs, scales, stride, world, server_error, chunk, packed, stream);
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

}  // namespace compcomm::kernels::cpu
