// take_rows(table, ids) = table[ids] for a 2-D table: an embedding lookup by
// this extension's kernels. On CUDA, MLX compiles its gather kernels at run
// time (seconds each on a machine whose kernel cache is empty); these ship
// compiled. An id outside [0, rows) gives a zero row.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace flash_cce {

namespace mx = mlx::core;

// table [rows, width] of any dtype, ids of any integer dtype and shape; the
// result has shape ids.shape + (width,) and table's dtype. No gradient (the
// Python wrapper gives one).
mx::array take_rows(const mx::array& table, const mx::array& ids, mx::StreamOrDevice s = {});

// Whether this build runs take_rows on the GPU (CUDA builds).
bool has_gpu_take_rows();

// Inputs: table (row-contiguous), ids int32 (contiguous). Output: the rows.
class TakeRows : public mx::Primitive {
 public:
  explicit TakeRows(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "TakeRows";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

} // namespace flash_cce
