// Tile loaders of the head kernels: a [32, BK] tile of a row-major operand
// into threadgroup memory of the GEMM's tile type T (row stride
// FCCE_TILE_LD(sizeof(T))), through MLX's steel loaders: BlockLoader for h and
// a dense w, QuantizedBlockLoader for an affine-quantized w. Both map thread
// tid to row tid / 4 and 8 consecutive columns (tid % 4) * 8 of the tile. A
// tile wholly inside its operand takes the loaders' unpredicated
// `load_unsafe`; only the edge tiles (past M or V rows, past H columns) take
// `load_safe`, which reads zeros there.
//
// T is the common type of h and the weights, as MLX's quantized_matmul
// resolves it: h's dtype when w (or a quantized w's scales) has the same;
// float otherwise. The plan casts a quantized head's h or scales and biases to
// float when they differ (csrc/metal/plan.cpp), so that both of its loaders
// read T. A dense head of two dtypes converts the operand that is not float
// with this file's converting loader (exact widening): casting w would copy
// [V, H].
#pragma once

namespace fcce {

static_assert(FCCE_BK == 32 && FCCE_BM == 32 && FCCE_BN == 32 && FCCE_THREADS == 128 &&
                  FCCE_WM * FCCE_WN * 32 == FCCE_THREADS,
              "the loaders map 128 threads onto 32 x 32 tiles");

// The tile type of a head whose h is A and whose w (or scales) is B.
template <typename A, typename B>
struct TileOf {
  using type = float;
};
template <typename A>
struct TileOf<A, A> {
  using type = A;
};

// Rows [r0, r0 + 32) and columns [c0, c0 + 32) of a dense [rows, cols]
// matrix of T into a T tile, through steel's BlockLoader: an interior tile
// unpredicated, an edge tile with its rows and columns inside the matrix
// (load_safe zero-fills the rest).
template <typename T>
METAL_FUNC void steel_tile(
    const device T* src, int rows, int cols, int r0, int c0, threadgroup T* tile,
    uint sgid, uint lane) {
  using Loader =
      mlx::steel::BlockLoader<T, FCCE_BM, FCCE_BK, FCCE_TILE_LD(sizeof(T)), 1, FCCE_THREADS>;
  Loader ld(src + size_t(r0) * size_t(cols) + c0, cols, tile, ushort(sgid), ushort(lane));
  if (r0 + FCCE_BM <= rows && c0 + FCCE_BK <= cols) {
    ld.load_unsafe();
  } else {
    ld.load_safe(short2(short(min(FCCE_BK, cols - c0)), short(min(FCCE_BM, rows - r0))));
  }
}

// The same tile of a matrix of S into a T tile: steel's loader where S is T.
template <typename S, typename T>
struct DenseTile {
  METAL_FUNC static void load(
      const device S* src, int rows, int cols, int r0, int c0, threadgroup T* tile,
      uint sgid, uint lane) {
    steel_tile<T>(src, rows, cols, r0, c0, tile, sgid, lane);
  }
};

// S is not T (then T is float): each thread converts its 8 elements, zero
// past the operand's rows or columns.
template <typename S>
struct DenseTile<S, float> {
  METAL_FUNC static void load(
      const device S* src, int rows, int cols, int r0, int c0, threadgroup float* tile,
      uint sgid, uint lane) {
    const int tid = int(sgid) * 32 + int(lane);
    const int r = tid / 4, c = (tid % 4) * 8;
    threadgroup float* dst = tile + r * FCCE_TILE_LD(sizeof(float)) + c;
    if (r0 + r >= rows) {
      for (int j = 0; j < 8; ++j) {
        dst[j] = 0.0f;
      }
      return;
    }
    const device S* row = src + size_t(r0 + r) * size_t(cols);
    for (int j = 0; j < 8; ++j) {
      const int col = c0 + c + j;
      dst[j] = col < cols ? float(row[col]) : 0.0f;
    }
  }
};

template <>
struct DenseTile<float, float> {
  METAL_FUNC static void load(
      const device float* src, int rows, int cols, int r0, int c0, threadgroup float* tile,
      uint sgid, uint lane) {
    steel_tile<float>(src, rows, cols, r0, c0, tile, sgid, lane);
  }
};

// A dense head weight w [V, H] in its own dtype WT, in tiles of its head's T.
template <typename WT, typename T>
struct DenseWeight {
  using Tile = T;
  const device WT* w;

  METAL_FUNC void load(const constant FcceParams& p, int v0, int k0, threadgroup T* tile,
                       uint sgid, uint lane) const {
    DenseTile<WT, T>::load(w, p.V, p.H, v0, k0, tile, sgid, lane);
  }
};

// An MLX affine-quantized head: packed rows of H * bits / 8 bytes, one
// (scale, bias) of T per group_size weights, dequantized into T tiles by MLX's
// QuantizedBlockLoader (non-transposed: reduction along a row). H is a
// multiple of the group size (>= 32), so only the last vocabulary block is an
// edge tile.
template <typename T, int bits, int group_size>
struct QuantWeight {
  using Tile = T;
  using Loader = QuantizedBlockLoader<T, FCCE_BN, FCCE_BK, FCCE_TILE_LD(sizeof(T)), 1,
                                      FCCE_THREADS, group_size, bits>;
  const device uint8_t* w;
  const device T* scales;
  const device T* biases;

  METAL_FUNC void load(const constant FcceParams& p, int v0, int k0, threadgroup T* tile,
                       uint sgid, uint lane) const {
    const size_t g = size_t(v0) * size_t(p.groups) + size_t(k0 / group_size);
    Loader ld(w + size_t(v0) * size_t(p.row_bytes) + size_t(k0 / 8 * bits), scales + g,
              biases + g, p.H, tile, ushort(sgid), ushort(lane));
    if (v0 + FCCE_BN <= p.V) {
      ld.load_unsafe();
    } else {
      ld.load_safe(short2(FCCE_BK, short(p.V - v0)));
    }
  }
};

} // namespace fcce
