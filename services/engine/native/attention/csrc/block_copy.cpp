// Whole-block copies between two KV pools on the CPU: one memcpy per block, the blocks spread over
// torch's intra-op threads. torch's index_copy_ (the scatter half of a gather-and-scatter) copies
// on one thread, at a fifth of a gather's speed here; a staged LayerKV layer and a swap both scatter.
#include "block_copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace kvmesh {
namespace {

constexpr int64_t kGrainBytes = 256 << 10;  // bytes per task: less is not worth a second thread

void check_rows(const at::Tensor& rows, int64_t count, int64_t limit, const char* name) {
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                        rows.is_contiguous(),
                    "copy_rows: ", name, " must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK_VALUE(rows.numel() == count, "copy_rows: ", count, " source rows but ", rows.numel(), " ", name);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < limit, "copy_rows: ", name, " has row ", r[i], " outside [0, ", limit, ")");
}

}  // namespace

void copy_rows(const at::Tensor& source, const at::Tensor& source_rows, at::Tensor& target,
               const at::Tensor& target_rows) {
  TORCH_CHECK_VALUE(source.device().is_cpu() && target.device().is_cpu(), "copy_rows: CPU tensors only");
  TORCH_CHECK_VALUE(source.is_contiguous() && target.is_contiguous() && source.dim() >= 1 && target.dim() >= 1,
                    "copy_rows: source and target must be contiguous");
  TORCH_CHECK_VALUE(source.scalar_type() == target.scalar_type(), "copy_rows: source and target dtypes differ");
  TORCH_CHECK_VALUE(source.data_ptr() != target.data_ptr(), "copy_rows: source and target are one tensor");
  const int64_t row_bytes = source.size(0) ? source.nbytes() / source.size(0) : 0;
  TORCH_CHECK_VALUE(target.size(0) == 0 || target.nbytes() / target.size(0) == row_bytes,
                    "copy_rows: source and target rows differ in size");
  const int64_t n = source_rows.numel();
  check_rows(source_rows, n, source.size(0), "source_rows");
  check_rows(target_rows, n, target.size(0), "target_rows");
  if (n == 0) return;
  const int64_t* from = source_rows.data_ptr<int64_t>();
  const int64_t* to = target_rows.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(source.data_ptr());
  char* dst = static_cast<char*>(target.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + to[i] * row_bytes, src + from[i] * row_bytes, row_bytes);
  });
}

}  // namespace kvmesh
