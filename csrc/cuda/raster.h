// Block orders of the persistent kernels: plain integer arithmetic, shared by
// the kernels and the host tests.
#pragma once

#include <algorithm>

#ifdef __CUDACC__
#define FCCE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FCCE_HOST_DEVICE inline
#endif

namespace flash_cce::cuda {

struct FwdBlock {
  int mt, split;
};

// The (m tile, split) of forward block b of p.m_tiles x p.splits. Blocks run
// in groups of p.m_group m tiles, the m tile fastest within a group: the rows
// of h in flight are those of one group, and each split's W tiles are read by
// the group's blocks together. m_group = m_tiles gives the plain m-fastest
// order. P: anything with those three int fields (FwdParams in the kernels).
template <class P>
FCCE_HOST_DEVICE FwdBlock fwd_block(const P& p, int b) {
  const int per = p.m_group * p.splits, g = b / per, r = b - g * per;
#ifdef __CUDA_ARCH__
  const int gm = min(p.m_group, p.m_tiles - g * p.m_group);
#else
  const int gm = std::min(p.m_group, p.m_tiles - g * p.m_group);
#endif
  return {g * p.m_group + r % gm, r / gm};
}

// One work unit of a persistent dh kernel: k-steps [kt0, kt1) of a tile,
// piece `piece` of the tile's `pieces`.
struct DhUnit {
  int tile, kt0, kt1, piece, pieces;
};

// How a dh launch of `tiles` output tiles on `grid` blocks splits its last
// round (DhSplit in params.h): when that round would hold `tail` < grid tiles,
// each of them becomes up to `max_splits` pieces of at least `min_steps`
// k-steps, so that the round takes 1 / splits of a tile's time. Sets whole,
// tail and splits of S.
template <class S>
inline void plan_dh_split(S& s, int tiles, int grid, int kt_count, int max_splits,
                          int min_steps) {
  const int rounds = (tiles + grid - 1) / grid;
  const int tail = tiles - (rounds - 1) * grid;
  const int splits = std::min(std::min(max_splits, grid / tail), kt_count / min_steps);
  s.whole = splits < 2 ? tiles : tiles - tail;
  s.tail = splits < 2 ? 0 : tail;
  s.splits = splits < 2 ? 1 : splits;
}

template <class S>
FCCE_HOST_DEVICE int dh_units(const S& s) {
  return s.whole + s.tail * s.splits;
}

// Unit u of plan s: whole tiles first, then piece u / tail of each tail tile.
template <class S>
FCCE_HOST_DEVICE DhUnit dh_unit(const S& s, int u, int kt_count) {
  if (u < s.whole) {
    return {u, 0, kt_count, 0, 1};
  }
  const int i = u - s.whole, piece = i / s.tail;
  return {s.whole + i - piece * s.tail, piece * kt_count / s.splits,
          (piece + 1) * kt_count / s.splits, piece, s.splits};
}

} // namespace flash_cce::cuda
