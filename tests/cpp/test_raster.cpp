// The forward's block order (cuda/raster.h) on the host: every (m tile, split)
// exactly once, each group's blocks on that group's m tiles only, the m tile
// fastest within a group.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/raster.h"

using flash_cce::cuda::fwd_block;

namespace {
struct Grid {
  int m_tiles, splits, m_group;
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
