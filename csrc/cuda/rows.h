// CUDA evaluation of take_rows (the primitive in ../rows.h).
#pragma once

#include <vector>

#include "../rows.h"

namespace flash_cce::cuda {

// Inputs: table [rows, width] row-contiguous, ids int32 contiguous; out: the rows.
void take_rows(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out);

} // namespace flash_cce::cuda
