// Argument checks shared by the quantised linear kernels (quant_linear.cpp, quant_linear_bf16.cpp):
// a bad call raises ValueError with what was expected and what came.
#pragma once

#include <torch/extension.h>

namespace kvmesh {

constexpr int kQuantBlock = 32;  // weights per GGUF block, along K

inline void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
                    ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [T, K] with contiguous rows, got sizes ",
                    x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(x.size(1) % kQuantBlock == 0, name, ": K=", x.size(1), " is not a multiple of ", kQuantBlock);
}

inline void check_residual(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& residual, const char* name) {
  if (residual.has_value()) {
    const at::Tensor& res = *residual;
    TORCH_CHECK_VALUE(res.device().is_cpu() && res.scalar_type() == x.scalar_type() && res.dim() == 2 &&
                          res.size(0) == x.size(0) && res.size(1) == N && res.stride(1) == 1,
                      name, ": residual must be a CPU [", x.size(0), ", ", N, "] tensor of x's dtype (",
                      x.scalar_type(), ") with contiguous rows, got ", res.scalar_type(), " ", res.sizes());
  }
}

inline void check_table(const at::Tensor& t, int64_t N, int64_t blocks, const char* what, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == N &&
                        t.size(1) == blocks && t.is_contiguous(),
                    name, ": ", what, " must be contiguous float32 [", N, ", ", blocks, "] on the CPU, got ",
                    t.scalar_type(), " ", t.sizes());
}

}  // namespace kvmesh
