// One-pass fp64 sums of squares (the gradient norms of ZeRO's compressed phase: one read of the
// fp32/fp16/bf16 data instead of converting it to an fp64 copy first). CPU only; GPU tensors keep the
// torch ops. Raw pointers, a status, no allocation, no framework headers.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace compcomm::kernels::cpu {

// *out = sum_k fl64(x_k)^2 over k < n, accumulated in fp64 in 8 interleaved partial sums (element k
// into sum k % 8, added in order at the end): the same value for the same input on every machine
// (no contraction, no vector-width dependence). NaN/Inf propagate.
Status sum_squares(const void* x, InputType dtype, int64_t n, double* out);

}  // namespace compcomm::kernels::cpu
