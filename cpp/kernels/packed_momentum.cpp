// CPU twins of the packed-momentum kernels (packed_momentum.h).
#include "packed_momentum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "half.h"

namespace compcomm::kernels::cpu {
namespace {

inline float load(const void* x, InputType t, int64_t k) {
  switch (t) {
    case InputType::kFloat16: return half::half_to_float(static_cast<const uint16_t*>(x)[k]);
    case InputType::kBFloat16: return half::bf16_to_float(static_cast<const uint16_t*>(x)[k]);
    default: return static_cast<const float*>(x)[k];
  }
}

// Runs at least this long build a 256-entry table (2048 values) instead of decoding bit by bit.
constexpr int64_t kTableMin = 1 << 14;

}  // namespace

Status unpack_momentum(const uint8_t* signs, const float* scales, int64_t chunk, int64_t numel,
                       int64_t begin, int64_t count, float mul, float* out) {
  if (count < 0 || begin < 0 || numel < 0 || (count > 0 && chunk < 1)) return Status::kInvalidArgument;
  const int64_t live = std::clamp<int64_t>(numel - begin, 0, count);
  // Chunk by chunk (one scale per run); -t is t with its sign bit flipped, so an element is the
  // scale's bits XOR (bit 0 ? sign : 0): whole bytes take a branch-free loop the compiler vectorises.
  for (int64_t i = 0; i < live;) {
    const int64_t j = (begin + i) / chunk;
    const int64_t stop = std::min(live, (j + 1) * chunk - begin);
    const uint32_t t = half::float_to_bits(scales[j] * mul);
    auto one = [&](int64_t i1) {
      const int64_t k = begin + i1;
      const uint32_t neg = ((~signs[k >> 3] >> (7 - (k & 7))) & 1u) << 31;
      out[i1] = half::bits_to_float(t ^ neg);
    };
    for (; i < stop && ((begin + i) & 7); ++i) one(i);
    const uint8_t* byte = signs + ((begin + i) >> 3);
    if (stop - i >= kTableMin) {  // long runs: the 8 values of every byte value, then 32-byte copies
      uint32_t table[256][8];
      for (uint32_t v = 0; v < 256; ++v)
        for (int b = 0; b < 8; ++b) table[v][b] = t ^ ((((~v) >> (7 - b)) & 1u) << 31);
      for (; i + 8 <= stop; i += 8, ++byte) std::memcpy(out + i, table[*byte], sizeof(table[0]));
    }
    for (; i + 8 <= stop; i += 8, ++byte) {
      const uint32_t inv = static_cast<uint8_t>(~*byte);
      for (int b = 0; b < 8; ++b) out[i + b] = half::bits_to_float(t ^ (((inv >> (7 - b)) & 1u) << 31));
    }
    for (; i < stop; ++i) one(i);
  }
  std::fill(out + live, out + count, 0.0f);
  return Status::kSuccess;
}

Status pack_momentum(const void* x, InputType dtype, int64_t count, int64_t chunk, uint8_t* signs,
                     float* scales) {
  if (count < 0 || count % 8 != 0 || (count > 0 && (chunk < 1 || count % chunk != 0)))
    return Status::kInvalidArgument;
  for (int64_t b = 0; b < count / 8; ++b) {
    uint8_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) byte |= static_cast<uint8_t>(!(load(x, dtype, 8 * b + bit) < 0.0f)) << (7 - bit);
    signs[b] = byte;
  }
  // The largest |x| of each chunk, NaN if the chunk holds one (as torch's amax in pack_torch, which
  // gives the default quiet NaN whatever the input NaN's bits; std::max would drop it); +-inf -> +inf.
  for (int64_t j = 0; count > 0 && j < count / chunk; ++j) {
    float mx = 0.0f;
    for (int64_t k = j * chunk; k < (j + 1) * chunk; ++k) {
      const float a = std::fabs(load(x, dtype, k));
      if (std::isnan(a)) {
        mx = std::numeric_limits<float>::quiet_NaN();
        break;
      }
      mx = std::max(mx, a);
    }
    scales[j] = mx;
  }
  return Status::kSuccess;
}

}  // namespace compcomm::kernels::cpu
