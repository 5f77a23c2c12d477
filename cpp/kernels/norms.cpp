// CPU one-pass fp64 sum of squares (norms.h). The file is compiled without multiply-add contraction so
// the partial sums are the same on every machine.
#include "norms.h"

#include "half.h"

namespace compcomm::kernels::cpu {
namespace {

template <class Load>
double sum_squares_of(int64_t n, Load load) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) {
      const double v = load(k + j);
      s[j] += v * v;
    }
  for (int j = 0; k < n; ++k, ++j) {
    const double v = load(k);
    s[j] += v * v;
  }
  double total = 0.0;
  for (double v : s) total += v;
  return total;
}

}  // namespace

Status sum_squares(const void* x, InputType dtype, int64_t n, double* out) {
  if (n < 0 || (n > 0 && x == nullptr)) return Status::kInvalidArgument;
  switch (dtype) {
    case InputType::kFloat16: {
      const auto* p = static_cast<const uint16_t*>(x);
      *out = sum_squares_of(n, [p](int64_t k) { return static_cast<double>(half::half_to_float(p[k])); });
      break;
    }
    case InputType::kBFloat16: {
      const auto* p = static_cast<const uint16_t*>(x);
      *out = sum_squares_of(n, [p](int64_t k) { return static_cast<double>(half::bf16_to_float(p[k])); });
      break;
    }
    default: {
      const auto* p = static_cast<const float*>(x);
      *out = sum_squares_of(n, [p](int64_t k) { return static_cast<double>(p[k]); });
    }
  }
  return Status::kSuccess;
}

}  // namespace compcomm::kernels::cpu
