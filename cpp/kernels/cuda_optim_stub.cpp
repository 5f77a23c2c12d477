// Stands in for the multi-tensor optimizer kernels in builds without a CUDA toolkit: kNotBuilt.
#include "optim_kernels.h"

namespace compcomm::kernels::cuda {
Status onebit_momentum(int, const int64_t*, float* const*, const float* const*, const float* const*, double,
                       Stream) {
  return Status::kNotBuilt;
}
Status onebit_compressed_step(int, const int64_t*, const float* const*, float* const*, const float* const*,
                              float* const*, void* const*, const InputType*, const AdamHyper&, const uint8_t*,
                              Stream) {
  return Status::kNotBuilt;
}
Status onebit_local_step(int, const int64_t*, float* const*, const float* const*, const float* const*,
                         float* const*, void* const*, const InputType*, const AdamHyper&, const uint8_t*,
                              Stream) {
  return Status::kNotBuilt;
}
Status adam_warmup_step(int, const int64_t*, float* const*, float* const*, const float* const*,
                        float* const*, void* const*, const InputType*, const AdamHyper&, const uint8_t*,
                              Stream) {
  return Status::kNotBuilt;
}
Status finite_gate(int, const int64_t*, const float* const*, uint8_t*, Stream) { return Status::kNotBuilt; }
int64_t lamb_partials(int, const int64_t*) { return 0; }
Status lamb_momentum(const cpu::LambCoeffs&, int, const int64_t*, float* const*, const float* const*,
                     float* const*, const float*, Stream) {
  return Status::kNotBuilt;
}
Status lamb_stats(const cpu::LambCoeffs&, int, const int64_t*, float* const*, const float* const*,
                  const float* const*, const float* const*, float* const*, const float* const*,
                  const float*, double*, float*, const uint8_t*, Stream) {
  return Status::kNotBuilt;
}
Status lamb_apply(const cpu::LambCoeffs&, int, const int64_t*, const float* const*,
                  const float* const*, float* const*, const float*, Stream) {
  return Status::kNotBuilt;
}
}  // namespace compcomm::kernels::cuda
