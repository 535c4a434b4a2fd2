// Launch planning (cuda/plan.h) and the tuning fields (tuning.h) on the host:
// defaults from the device's attributes, overrides from the tuning, and the
// bounds every planned size keeps.
#include <gtest/gtest.h>

#include <stdexcept>

#include "cuda/plan.h"
#include "flash_cce.h"

using flash_cce::HeadTuning;
using namespace flash_cce::cuda;

namespace {
constexpr int64_t MB = int64_t(1) << 20;
const DeviceInfo kH100{132, 50 * MB};

template <class F>
bool rejects(F f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return true;
  }
  return false;
}
} // namespace

TEST(Plan, DefaultsFollowTheDevice) {
  const auto p = plan_launch(HeadTuning{}, kH100);
  EXPECT_EQ(p.sms, 132);
  EXPECT_EQ(p.fwd_l2_bytes, 16 * MB); // 16/50 of the L2
  EXPECT_EQ(p.row_block, 4096);
  EXPECT_EQ(p.dh_splits, 4);
  EXPECT_EQ(p.vocab_chunk, 0);
  const auto small = plan_launch(HeadTuning{}, DeviceInfo{46, 6 * MB});
  EXPECT_EQ(small.sms, 46);
  EXPECT_EQ(small.fwd_l2_bytes, 6 * MB * 16 / 50);
}

TEST(Plan, TuningOverridesDefaults) {
  HeadTuning t;
  t.row_block = 100;
  t.vocab_chunk = 256;
  t.fwd_l2_mb = 3;
  t.dh_splits = 1;
  t.chunk_mb = 96;
  const auto p = plan_launch(t, kH100);
  EXPECT_EQ(p.row_block, 100);
  EXPECT_EQ(p.chunk_bytes, 96 * MB);
  EXPECT_EQ(p.vocab_chunk, 256);
  EXPECT_EQ(p.fwd_l2_bytes, 3 * MB);
  EXPECT_EQ(p.dh_splits, 1);
  EXPECT_EQ(p.sms, 132); // the device's, whatever the tuning
}

TEST(Plan, ForwardSplitsFillEightWavesWithinBounds) {
  const auto p = plan_launch(HeadTuning{}, kH100);
  EXPECT_EQ(forward_splits(p, 128, 5000, 1), 132 * 8);  // one m tile: 8 waves
  EXPECT_EQ(forward_splits(p, 1024, 1000, 8), 132);     // 8 m tiles share them
  EXPECT_EQ(forward_splits(p, 128, 10, 1), 10);         // at most a split per v tile
  EXPECT_EQ(forward_splits(p, 8 << 20, 1000, 1), 1);    // partials under 32 MB
  const auto half = plan_launch(HeadTuning{}, DeviceInfo{66, 50 * MB});
  EXPECT_EQ(forward_splits(half, 128, 5000, 1), 66 * 8);
}

TEST(Plan, ForwardGroupFitsTheL2Budget) {
  const auto p = plan_launch(HeadTuning{}, kH100);
  // 128-row bf16 tiles of H = 4096 are 1 MB each: 16 fit 16 MB.
  EXPECT_EQ(forward_group(p, 64, 128, 4096, 2), 16);
  EXPECT_EQ(forward_group(p, 10, 128, 4096, 2), 10); // no more than there are
  EXPECT_EQ(forward_group(p, 64, 128, 1 << 20, 4), 1); // at least one
  HeadTuning t;
  t.fwd_l2_mb = 4;
  EXPECT_EQ(forward_group(plan_launch(t, kH100), 64, 128, 4096, 2), 4);
}

TEST(Plan, RowBlockAndVocabChunk) {
  const auto p = plan_launch(HeadTuning{}, kH100);
  EXPECT_EQ(row_block(p, 100), 100);
  EXPECT_EQ(row_block(p, 10000), 4096);
  // 48 MB of 16-bit columns for 4096 rows: 6144, a multiple of the tile.
  EXPECT_EQ(vocab_chunk(p, 4096, 200000, 256), 6144);
  EXPECT_EQ(vocab_chunk(p, 4096, 1000, 256), 1024); // V rounded up to tiles
  EXPECT_EQ(vocab_chunk(p, 1 << 20, 200000, 256), 256); // at least one tile
  // The dW path: at least kDwChunkCols columns, unless chunk_mb is set.
  EXPECT_EQ(vocab_chunk(p, 32768, 128256, 256, true), kDwChunkCols);
  EXPECT_EQ(vocab_chunk(p, 4096, 200000, 256, true), 6144);
  EXPECT_EQ(vocab_chunk(p, 32768, 1000, 256, true), 1024);
  HeadTuning set;
  set.chunk_mb = 48;
  EXPECT_EQ(vocab_chunk(plan_launch(set, kH100), 32768, 128256, 256, true), 768);
  HeadTuning t;
  t.vocab_chunk = 700;
  const auto q = plan_launch(t, kH100);
  EXPECT_EQ(vocab_chunk(q, 4096, 200000, 256), 512); // narrowed, whole tiles
  for (int64_t M : {1, 7, 100, 4096, 70000})
    for (int64_t V : {1, 255, 256, 257, 151936}) {
      const int64_t c = vocab_chunk(p, M, V, 256);
      EXPECT_EQ(c % 256, 0) << M << " " << V;
      EXPECT_GE(c, 256);
      EXPECT_LE(c, cdiv(V, 256) * 256);
      EXPECT_TRUE(c == 256 || c * 2 * M <= p.chunk_bytes) << M << " " << V;
    }
}

TEST(Plan, RowsCopyUnitIsTheWidestThatDividesRowAndAddresses) {
  EXPECT_EQ(rows_copy_unit(5120, 0x1000, 0x2000), 16); // bf16 rows of 2560
  EXPECT_EQ(rows_copy_unit(5120, 0x1004, 0x2000), 4);  // a table 4 bytes into its buffer
  EXPECT_EQ(rows_copy_unit(5120, 0x1000, 0x2008), 4);  // the output's address counts too
  EXPECT_EQ(rows_copy_unit(12, 0x1000, 0x2000), 4);    // fp32 rows of 3
  EXPECT_EQ(rows_copy_unit(6, 0x1000, 0x2000), 2);     // bf16 rows of 3
  EXPECT_EQ(rows_copy_unit(3, 0x1000, 0x2000), 1);     // uint8 rows of 3
  EXPECT_EQ(rows_copy_unit(32, 0x1001, 0x2000), 1);
  EXPECT_EQ(rows_copy_unit(0, 0x1000, 0x2000), 16);    // empty rows copy nothing
}

TEST(Tuning, KeysSetAndCompare) {
  HeadTuning t;
  flash_cce::set_tuning(t, "wgmma", 0, true);
  flash_cce::set_tuning(t, "row_block", 100, false);
  EXPECT_FALSE(t.wgmma);
  EXPECT_EQ(t.row_block, 100);
  EXPECT_FALSE(t == HeadTuning{});
  const auto items = flash_cce::tuning_items(t);
  ASSERT_EQ(items.size(), flash_cce::tuning_keys().size());
  HeadTuning u;
  for (const auto& it : items) {
    flash_cce::set_tuning(u, it.key, it.value, it.flag);
  }
  EXPECT_TRUE(u == t); // every field round-trips through its key
  EXPECT_TRUE(rejects([&] { flash_cce::set_tuning(t, "nope", 1, false); }));
  EXPECT_TRUE(rejects([&] { flash_cce::set_tuning(t, "wgmma", 1, false); }));
  EXPECT_TRUE(rejects([&] { flash_cce::set_tuning(t, "row_block", 1, true); }));
  EXPECT_TRUE(rejects([&] { flash_cce::set_tuning(t, "row_block", -1, false); }));
  HeadTuning neg;
  neg.dh_splits = -2;
  EXPECT_TRUE(rejects([&] { flash_cce::check_tuning(neg); }));
}

TEST(Tuning, PrimitivesWithOtherTuningAreNotEquivalent) {
  flash_cce::HeadConfig a, b;
  b.tuning.wgmma = false;
  EXPECT_FALSE(a == b);
  const flash_cce::mx::Stream s(0, flash_cce::mx::Device::cpu);
  flash_cce::FlashCCEForward fa(s, a), fa2(s, a), fb(s, b);
  EXPECT_TRUE(fa.is_equivalent(fa2));
  EXPECT_FALSE(fa.is_equivalent(fb));
  flash_cce::FlashCCEBackward ba(s, a, false), bb(s, b, false);
  EXPECT_FALSE(ba.is_equivalent(bb));
}
