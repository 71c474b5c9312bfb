// The elementwise steps of a decoder layer, one pass each on CPU (layer_ops.cpp).
#pragma once

#include <torch/extension.h>

namespace kvmesh {

// weight * (x * rsqrt(mean(x^2) + eps)) over each row of x [T, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Rotary on qk [T, H, D] (rows may be strided): qk * cos + roll(qk, D / 2) * sin, cos and sin [T, 1, D].
at::Tensor rotary(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin);
// silu(gate) * up of gate_up [T, 2I] = [gate | up]: [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace kvmesh
