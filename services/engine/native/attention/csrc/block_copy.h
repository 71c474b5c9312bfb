// Whole-block copies between two KV pools on the CPU (block_copy.cpp).
#pragma once

#include <torch/extension.h>

namespace kvmesh {

// target[target_rows[i]] = source[source_rows[i]] for each i: rows along dim 0 of two contiguous
// tensors of one dtype and row size, distinct tensors, int64 row indices. The rows are copied in
// parallel; a target row named twice ends up as one of its sources.
void copy_rows(const at::Tensor& source, const at::Tensor& source_rows, at::Tensor& target,
               const at::Tensor& target_rows);

}  // namespace kvmesh
