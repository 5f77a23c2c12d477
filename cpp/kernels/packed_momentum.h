// The packed 1-bit momentum of ZeRO + OneBitAdam (issue 19). After a compressed allreduce the
// momentum is m_k = scale_j * s_k (chunk j = k / chunk, s_k = +-1), identical on every rank, so it is
// kept as count/8 bytes of signs (MSB first, bit 1 = +1, as kernels.h) plus one fp32 scale per chunk:
// about P/8 bytes instead of 4 P. CPU twins only: GPU tensors take the torch-op path of
// compcomm.zero.packed_momentum, which the tests hold to these kernels. Raw pointers, a status, no
// allocation, no framework headers.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace compcomm::kernels::cpu {

// out[i] = fl(scales[k / chunk] * mul) * (bit k of signs ? +1 : -1) for k = begin + i < numel, and
// +0 for numel <= k (bucket padding: 1 bit cannot say 0), i < count. With mul = 1 the values are the
// bits compressed_allreduce decompressed (exact); with mul = b1 they are fl(m_k * b1), the first
// operation of 1-bit Adam's local momentum, in the same pass (the sign is symmetric). chunk >= 1
// unless count == 0.
Status unpack_momentum(const uint8_t* signs, const float* scales, int64_t chunk, int64_t numel,
                       int64_t begin, int64_t count, float mul, float* out);

// The packed form of a 1-bit tensor x (count elements of dtype, count % 8 == 0): signs[count/8] with
// bit k = !(x_k < 0), and scales[j] = max_k |x_k| over chunk j (count / chunk chunks; count % chunk
// == 0). For a tensor of the form scale_j * s_k (padding +0) this is its exact packed form; -0.0 reads
// as +1 (kernels.h's convention). Used where the compressor cannot hand its records back.
Status pack_momentum(const void* x, InputType dtype, int64_t count, int64_t chunk, uint8_t* signs,
                     float* scales);

}  // namespace compcomm::kernels::cpu
