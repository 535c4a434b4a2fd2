// The persistent kernels' work orders (cuda/raster.h) on the host. Forward:
// every (m tile, split) exactly once, each group's blocks on that group's m
// tiles only, the m tile fastest within a group. dh: every k-step of every
// tile exactly once, split tiles only in the last round.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/raster.h"

using flash_cce::cuda::dh_unit;
using flash_cce::cuda::dh_units;
using flash_cce::cuda::fwd_block;
using flash_cce::cuda::plan_dh_split;

namespace {
struct Grid {
  int m_tiles, splits, m_group;
};
struct Split {
  int whole, tail, splits;
};
} // namespace

TEST(Raster, EveryTileOnceAndGroupsKeepTheirMTiles) {
  for (int m_tiles = 1; m_tiles <= 37; ++m_tiles)
    for (int splits = 1; splits <= 6; ++splits)
      for (int m_group = 1; m_group <= m_tiles; ++m_group) {
        const Grid p{m_tiles, splits, m_group};
        std::vector<int> seen(m_tiles * splits, 0);
        for (int b = 0; b < m_tiles * splits; ++b) {
          const auto [mt, split] = fwd_block(p, b);
          ASSERT_TRUE(mt >= 0 && mt < m_tiles && split >= 0 && split < splits)
              << m_tiles << " " << splits << " " << m_group << " b=" << b;
          ++seen[split * m_tiles + mt];
          // Group g = b / (m_group * splits) owns m tiles [g m_group, (g + 1) m_group).
          ASSERT_EQ(mt / m_group, b / (m_group * splits));
        }
        for (int c : seen) {
          ASSERT_EQ(c, 1) << m_tiles << " " << splits << " " << m_group;
        }
      }
}

TEST(Raster, MTileFastestWithinAGroup) {
  // 10 m tiles in groups of 4: the last group has 2, each run of the group's
  // m tiles is one split.
  const Grid p{10, 3, 4};
  const int expect[][2] = {{0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {1, 1}};
  for (int b = 0; b < 6; ++b) {
    const auto [mt, split] = fwd_block(p, b);
    EXPECT_EQ(mt, expect[b][0]);
    EXPECT_EQ(split, expect[b][1]);
  }
  const int tail[][2] = {{8, 0}, {9, 0}, {8, 1}, {9, 1}, {8, 2}, {9, 2}};
  for (int i = 0; i < 6; ++i) {
    const auto [mt, split] = fwd_block(p, 24 + i);
    EXPECT_EQ(mt, tail[i][0]);
    EXPECT_EQ(split, tail[i][1]);
  }
}

TEST(Raster, OneGroupIsThePlainOrder) {
  const Grid p{13, 5, 13};
  for (int b = 0; b < 65; ++b) {
    const auto [mt, split] = fwd_block(p, b);
    EXPECT_EQ(mt, b % 13);
    EXPECT_EQ(split, b / 13);
  }
}

TEST(DhSplit, EveryKStepOfEveryTileOnceInOrder) {
  for (int grid : {1, 7, 132})
    for (int tiles = 1; tiles <= 3 * grid + 5; ++tiles)
      for (int kt : {1, 3, 8, 17, 96}) {
        Split s{};
        plan_dh_split(s, tiles, grid, kt, 4, 4);
        const int units = dh_units(s);
        ASSERT_LE(units - s.whole, grid) << "pieces run in one round";
        std::vector<int> next(tiles, 0); // the k-step each tile's pieces reached
        for (int u = 0; u < units; ++u) {
          const auto d = dh_unit(s, u, kt);
          ASSERT_TRUE(d.tile >= 0 && d.tile < tiles);
          ASSERT_EQ(d.kt0, next[d.tile]) << "pieces of a tile in order of k";
          ASSERT_LT(d.kt0, d.kt1);
          ASSERT_TRUE(d.pieces == 1 || d.kt1 - d.kt0 >= 4) << "pieces of at least 4 k-steps";
          next[d.tile] = d.kt1;
        }
        for (int t = 0; t < tiles; ++t) {
          ASSERT_EQ(next[t], kt) << grid << " " << tiles << " " << kt;
        }
      }
}

TEST(DhSplit, LastRoundSplitsOnlyWhenItIsShort) {
  // 320 tiles on 132 blocks: two whole rounds, 56 tiles left in two pieces.
  Split s{};
  plan_dh_split(s, 320, 132, 96, 4, 4);
  EXPECT_EQ(s.whole, 264);
  EXPECT_EQ(s.tail, 56);
  EXPECT_EQ(s.splits, 2);
  // 160 tiles: 28 left, four pieces each.
  plan_dh_split(s, 160, 132, 192, 4, 4);
  EXPECT_EQ(s.tail, 28);
  EXPECT_EQ(s.splits, 4);
  // Whole rounds, a last round more than half full, or too few k-steps: none.
  for (auto [tiles, kt] : {std::pair{264, 96}, {200, 96}, {30, 7}}) {
    plan_dh_split(s, tiles, 132, kt, 4, 4);
    EXPECT_EQ(s.splits, 1);
    EXPECT_EQ(s.whole, tiles);
    EXPECT_EQ(dh_units(s), tiles);
  }
}
