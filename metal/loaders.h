// Tile loaders of the head kernels: a [32, BK] tile of a row-major operand,
// converted to float in threadgroup memory (row stride FCCE_LD). Each of the
// 128 threads fills 8 consecutive columns of one row: row tid / 4, columns
// (tid % 4) * 8 ... + 7. Reads past the operand's rows or columns give zero.
// Needs MLX's quantized.h (dequantize, get_pack_factor, get_bytes_per_pack).
#pragma once

namespace fcce {

static_assert(FCCE_BK == 32 && FCCE_BM == 32 && FCCE_BN == 32 && FCCE_THREADS == 128 &&
                  FCCE_WM * FCCE_WN * 32 == FCCE_THREADS,
              "the loaders map 128 threads onto 32 x 32 tiles");

// Rows [r0, r0 + 32) and columns [c0, c0 + 32) of a dense [rows, cols] matrix.
template <typename T>
METAL_FUNC void load_dense_tile(
    const device T* src, int rows, int cols, int r0, int c0,
    threadgroup float* tile, uint tid) {
  const int r = int(tid) / 4, c = int(tid % 4) * 8;
  threadgroup float* dst = tile + r * FCCE_LD + c;
  if (r0 + r >= rows) {
    for (int j = 0; j < 8; ++j) {
      dst[j] = 0.0f;
    }
    return;
  }
  const device T* row = src + size_t(r0 + r) * size_t(cols);
  for (int j = 0; j < 8; ++j) {
    const int col = c0 + c + j;
    dst[j] = col < cols ? float(row[col]) : 0.0f;
  }
}

// Element i of a scales or biases array of dtype `kind` (FcceParams::sb_dtype:
// 0 float32, 1 float16, 2 bfloat16), read from its raw bytes.
METAL_FUNC float load_scale(const device uint8_t* base, int kind, size_t i) {
  if (kind == 0) {
    return ((const device float*)base)[i];
  }
  const ushort bits = ((const device ushort*)base)[i];
  return kind == 1 ? float(as_type<half>(bits)) : as_type<float>(uint(bits) << 16);
}

// A dense head weight w [V, H] in its own dtype.
template <typename T>
struct DenseWeight {
  const device T* w;

  METAL_FUNC void load(const constant FcceParams& p, int v0, int k0,
                       threadgroup float* tile, uint tid) const {
    load_dense_tile(w, p.V, p.H, v0, k0, tile, tid);
  }
};

// An MLX affine-quantized head: packed rows of H * bits / 8 bytes, one
// (scale, bias) per group_size weights. H is a multiple of the group size
// (>= 32), so a tile never crosses the row's end and its 8-column pieces never
// cross a group; values come from MLX's dequantize in float.
template <int bits>
struct QuantWeight {
  const device uint8_t* w;
  const device uint8_t* scales;
  const device uint8_t* biases;

  METAL_FUNC void load(const constant FcceParams& p, int v0, int k0,
                       threadgroup float* tile, uint tid) const {
    constexpr int pack = get_pack_factor<bits, 8>();
    constexpr int pack_bytes = get_bytes_per_pack<bits>();
    const int r = int(tid) / 4, c = int(tid % 4) * 8, v = v0 + r;
    threadgroup float* dst = tile + r * FCCE_LD + c;
    if (v >= p.V) {
      for (int j = 0; j < 8; ++j) {
        dst[j] = 0.0f;
      }
      return;
    }
    const int col = k0 + c;
    const size_t group = size_t(v) * size_t(p.groups) + size_t(col / p.group_size);
    const float scale = load_scale(scales, p.sb_dtype, group);
    const float bias = load_scale(biases, p.sb_dtype, group);
    const device uint8_t* src = w + size_t(v) * size_t(p.row_bytes) + (col / pack) * pack_bytes;
    for (int i = 0; i < 8 / pack; ++i) {
      dequantize<float, pack, bits>(src + i * pack_bytes, scale, bias, dst + i * pack);
    }
  }
};

} // namespace fcce
