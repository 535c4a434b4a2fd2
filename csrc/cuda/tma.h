// TMA descriptors of the Hopper kernels' operands.
#pragma once

#include <cuda.h>

#include "../head_kernels.h"

namespace flash_cce::cuda {

// TMA descriptor of a row-major [rows, cols] 16-bit matrix (row stride ld,
// default cols), read in boxes of box_rows x 64 with the 128-byte swizzle the
// wgmma descriptors expect.
CUtensorMap tensor_map(const void* ptr, mx::Dtype t, int64_t rows, int64_t cols, int box_rows,
                       int64_t ld = 0);

// TMA descriptor of a quantized W's packed words, [V, H * bits / 32] uint32,
// read in boxes of box_rows rows x box_cols columns of W, swizzled with the
// span of a box row (32, 64 or 128 bytes; tile_load in the kernels).
CUtensorMap packed_map(const HeadProblem& p, int box_rows, int box_cols);

} // namespace flash_cce::cuda
