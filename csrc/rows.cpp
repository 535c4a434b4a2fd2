#include "rows.h"

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#if defined(FLASH_CCE_CUDA)
#include "cuda/rows.h"
#endif

namespace flash_cce {

namespace {

// ids as int32. 64-bit ids are first clipped to [-1, rows] so that one outside
// the table cannot wrap into it; 32-bit unsigned ones past 2^31 turn negative.
mx::array int32_ids(const mx::array& ids, int64_t rows, mx::Stream s) {
  if (mx::size_of(ids.dtype()) == 8) {
    const bool is_signed = mx::issubdtype(ids.dtype(), mx::signedinteger);
    auto low = is_signed ? std::optional(mx::array(-1, ids.dtype())) : std::nullopt;
    return mx::astype(mx::clip(ids, low, mx::array(rows, ids.dtype()), s), mx::int32, s);
  }
  return mx::astype(ids, mx::int32, s);
}

// ids.shape + (width,): the rows in the order of the ids.
mx::Shape rows_shape(const mx::array& table, const mx::array& ids) {
  auto shape = ids.shape();
  shape.push_back(table.shape(1));
  return shape;
}

} // namespace

mx::array take_rows(const mx::array& table, const mx::array& ids, mx::StreamOrDevice s) {
  if (table.ndim() != 2) {
    throw std::invalid_argument("[flash_cce.take_rows] table must be 2-D [rows, width], got " +
                                std::to_string(table.ndim()) + " dimensions");
  }
  if (!mx::issubdtype(ids.dtype(), mx::integer)) {
    throw std::invalid_argument("[flash_cce.take_rows] ids must be integers");
  }
  auto stream = mx::to_stream(s);
  return mx::array(rows_shape(table, ids), table.dtype(), std::make_shared<TakeRows>(stream),
                   {mx::contiguous(table, false, stream),
                    mx::contiguous(int32_ids(ids, table.shape(0), stream), false, stream)});
}

std::vector<mx::Shape> TakeRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {rows_shape(inputs[0], inputs[1])};
}

void TakeRows::eval_cpu(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_input_array(inputs[1]);
  enc.set_output_array(out);
  enc.dispatch([table = inputs[0], ids = inputs[1], out]() mutable {
    const int64_t rows = table.shape(0);
    const size_t row_bytes = table.shape(1) * table.itemsize();
    const char* src = table.data<char>();
    const int32_t* id = ids.data<int32_t>();
    char* dst = out.data<char>();
    for (size_t i = 0; i < ids.size(); ++i, dst += row_bytes) {
      if (id[i] < 0 || id[i] >= rows) {
        std::memset(dst, 0, row_bytes);
      } else {
        std::memcpy(dst, src + id[i] * row_bytes, row_bytes);
      }
    }
  });
}

#if defined(FLASH_CCE_CUDA)
bool has_gpu_take_rows() {
  return true;
}
void TakeRows::eval_gpu(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  cuda::take_rows(stream(), inputs, outputs[0]);
}
#else
bool has_gpu_take_rows() {
  return false;
}
void TakeRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[flash_cce.take_rows] this build has no GPU kernel for it; use mx.take");
}
#endif

} // namespace flash_cce
