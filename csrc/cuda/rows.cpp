// Host side of take_rows on CUDA: one launch of fcce_take_rows (kernels.cu).
#include "rows.h"

#include <cuda.h>

#include "loader.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "params.h"
#include "plan.h"

namespace flash_cce::cuda {

namespace {

constexpr int kRowsPerBlock = 8; // warps of 32 threads, one row each

} // namespace

void take_rows(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& table = inputs[0];
  const auto& ids = inputs[1];
  auto& enc = mx::cu::get_command_encoder(s);
  mx::cu::device(s.device).make_current();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  RowsParams p{};
  p.table = mx::gpu_ptr<void>(table);
  p.ids = mx::gpu_ptr<int32_t>(ids);
  p.out = mx::gpu_ptr<void>(out);
  p.n = static_cast<int64_t>(ids.size());
  p.rows = table.shape(0);
  p.row_bytes = table.shape(1) * static_cast<int64_t>(table.itemsize());
  p.unit = rows_copy_unit(p.row_bytes, reinterpret_cast<uintptr_t>(p.table),
                          reinterpret_cast<uintptr_t>(p.out));
  enc.set_input_array(table);
  enc.set_input_array(ids);
  enc.set_output_array(out);
  if (p.n == 0 || p.row_bytes == 0) {
    return;
  }
  CUfunction fn = kernel_function("fcce_take_rows", s.device.index, 1);
  enc.add_kernel_node_ex(fn, dim3(static_cast<unsigned>(cdiv(p.n, kRowsPerBlock))),
                         dim3(32 * kRowsPerBlock), dim3(1), 0, p);
}

} // namespace flash_cce::cuda
