// CPU twins of the packed-momentum kernels (packed_momentum.h).
#include "packed_momentum.h"

#include <algorithm>
#include <cmath>

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

}  // namespace

Status unpack_momentum(const uint8_t* signs, const float* scales, int64_t chunk, int64_t numel,
                       int64_t begin, int64_t count, float* out) {
  if (count < 0 || begin < 0 || numel < 0 || (count > 0 && chunk < 1)) return Status::kInvalidArgument;
  const int64_t live = std::clamp<int64_t>(numel - begin, 0, count);
  // chunk by chunk, so the scale is loaded once per run instead of divided out per element
  for (int64_t i = 0; i < live;) {
    const int64_t k0 = begin + i, j = k0 / chunk;
    const int64_t stop = std::min(live, (j + 1) * chunk - begin);
    const float t = scales[j], neg = -t;
    for (; i < stop; ++i) {
      const int64_t k = begin + i;
      out[i] = (signs[k >> 3] >> (7 - (k & 7))) & 1 ? t : neg;
    }
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
  for (int64_t j = 0; count > 0 && j < count / chunk; ++j) {
    float mx = 0.0f;
    for (int64_t k = j * chunk; k < (j + 1) * chunk; ++k) mx = std::max(mx, std::fabs(load(x, dtype, k)));
    scales[j] = mx;
  }
  return Status::kSuccess;
}

}  // namespace compcomm::kernels::cpu
