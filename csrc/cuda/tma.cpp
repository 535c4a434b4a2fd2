#include "tma.h"

#include "loader.h"
#include "params.h"

namespace flash_cce::cuda {

namespace {

// A 2-D TMA descriptor over a row-major [rows, cols] matrix of `type` with
// row stride `pitch` bytes, read in boxes of box_rows x box_cols elements.
// Reads past rows or cols give zeros.
CUtensorMap encode_2d(const void* ptr, CUtensorMapDataType type, int64_t rows, int64_t cols,
                      int64_t pitch, int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  CUtensorMap m;
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch)};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t elem[2] = {1, 1};
  check(cuTensorMapEncodeTiled(&m, type, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
  return m;
}

} // namespace

CUtensorMap tensor_map(const void* ptr, mx::Dtype t, int64_t rows, int64_t cols, int box_rows,
                       int64_t ld) {
  return encode_2d(ptr,
                   t == mx::float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                   rows, cols, (ld ? ld : cols) * 2, box_rows, kWgTileK,
                   CU_TENSOR_MAP_SWIZZLE_128B);
}

CUtensorMap packed_map(const HeadProblem& p, int box_rows, int box_cols) {
  const int64_t words = p.H * p.cfg.bits / 32;
  const int row_bytes = box_cols * p.cfg.bits / 8;
  const CUtensorMapSwizzle swizzle = row_bytes == 32   ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_128B;
  return encode_2d(p.w, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.V, words, words * 4, box_rows,
                   box_cols * p.cfg.bits / 32, swizzle);
}

} // namespace flash_cce::cuda
