// fp16 / bf16 <-> fp32 conversions on raw 16-bit words, rounding to nearest even as torch does. Host
// code only (the CPU kernels, and the MPI communicator's 16-bit reductions).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace compcomm::half {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0)  // zero or subnormal: mant * 2^-24 is exact in fp32
    return bits_to_float(float_to_bits(std::ldexp(static_cast<float>(mant), -24)) | sign);
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  // NaN: quiet, with its sign and top 10 mantissa bits, as F16C's vcvtps2ph (the AVX2 / AVX-512
  // paths) and torch's conversion; so results do not depend on the vector width
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax & 0x7fffffu) >> 13));
  if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u)  // below 2^-14: subnormal (exact scaling, then round to nearest even)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(bits_to_float(ax) * 16777216.0f)));
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  // NaN: quiet, with its sign and top 7 mantissa bits (torch gives 0xffff or 0x7fc0 for every NaN)
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace compcomm::half
