// Linear layers on GGUF-quantised weights, read as they are stored (quant_linear.cpp).
#pragma once

#include <torch/extension.h>

namespace kvmesh {

// x [T, K] @ W^T (+ residual [T, N]) in x's dtype (float32 or bf16; rows of x may be strided),
// summed in float32 and rounded once. W [N, K] in Q4_1 blocks of 32 along K: weight 32b + j of
// row n is scales[n, b] * q + mins[n, b], q the low nibble of qs[n, 16b + j] for j < 16 and the
// high nibble of qs[n, 16b + j - 16] otherwise (GGUF's own order); qs uint8 [N, K / 2], scales
// and mins float32 [N, K / 32].
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
                       const c10::optional<at::Tensor>& residual);
// The same for W in Q8_0 blocks: weight k of row n is scales[n, k / 32] * qs[n, k], qs int8 [N, K].
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& residual);

// The fewest rows of bf16 x that take the AMX tile path (weights rounded to bf16 first, as the
// dense bf16 model's are), or 0 where there is none: built for a CPU with AMX-BF16 and granted its
// tile state by the kernel.
int64_t quant_linear_tile_rows();

// x [T, K] @ W^T (+ residual [T, N]) for bf16 x and W [N, K] in Q4_1 blocks laid out 16 rows side
// by side (quant_linear_bf16.cpp), G = ceil(N / 16) groups of rows: qs uint8 [G, K / 32 * 256],
// byte 2r + p of step l (32 bytes) of group g's block b the GGUF byte 2l + p of row 16g + r's block
// b; scales and mins float32 [G, K / 32 * 16], [g, 16b + r] of row 16g + r's block b. Rows past N
// are zeros. Summed in float32, rounded once to bf16.
at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t N, const c10::optional<at::Tensor>& residual);
// Whether q4_1_linear_bf16 is built here (for a CPU with AVX512-BF16).
bool quant_linear_bf16_dots();

}  // namespace kvmesh
