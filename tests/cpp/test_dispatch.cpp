// The CUDA kernel families' rules (cuda/rules.h) on the host: which heads may
// take the Hopper kernels, the register-operand kernels and the target gather,
// and the variants of the kernel names they launch (every one in entries.h).
#include <gtest/gtest.h>

#include <string>

#include "cuda/entries.h"
#include "cuda/rules.h"

using namespace flash_cce;
using namespace flash_cce::cuda;

namespace {

const void* aligned(uintptr_t at = 4096) {
  return reinterpret_cast<const void*>(at);
}

HeadProblem dense(mx::Dtype h = mx::bfloat16, mx::Dtype w = mx::bfloat16) {
  HeadProblem p;
  p.M = 100, p.H = 256, p.V = 1000;
  p.h = aligned(), p.w = aligned();
  p.h_dtype = h, p.w_dtype = w;
  return p;
}

HeadProblem quantized(int bits, int group_size = 64, mx::Dtype sb = mx::bfloat16) {
  HeadProblem p = dense();
  p.cfg.quantized = true;
  p.cfg.bits = bits;
  p.cfg.group_size = group_size;
  p.w_dtype = mx::uint32;
  p.sb_dtype = sb;
  return p;
}

bool in_table(const std::string& family, const std::string& variant) {
  return find_kernel(family, variant) != nullptr;
}

} // namespace

TEST(Dispatch, HopperFits) {
  EXPECT_TRUE(hopper_fits(dense()));
  EXPECT_TRUE(hopper_fits(dense(mx::float16, mx::float16)));
  EXPECT_FALSE(hopper_fits(dense(mx::float32, mx::float32))); // fp32 h
  EXPECT_FALSE(hopper_fits(dense(mx::bfloat16, mx::float32))); // mixed types
  auto odd = dense();
  odd.H = 252; // rows not 16-byte multiples
  EXPECT_FALSE(hopper_fits(odd));
  auto shifted = dense();
  shifted.h = aligned(4104);
  EXPECT_FALSE(hopper_fits(shifted));
  auto off = dense();
  off.cfg.tuning.wgmma = false;
  EXPECT_FALSE(hopper_fits(off));
  for (int gs : {32, 64, 128}) {
    EXPECT_TRUE(hopper_fits(quantized(4, gs))) << gs;
    EXPECT_TRUE(hopper_fits(quantized(8, gs))) << gs;
  }
  for (int bits : {2, 3, 5, 6}) {
    EXPECT_FALSE(hopper_fits(quantized(bits))) << bits;
  }
  // 4-bit needs scales of the operand type; 8-bit converts them in fp32.
  EXPECT_FALSE(hopper_fits(quantized(4, 64, mx::float16)));
  EXPECT_FALSE(hopper_fits(quantized(4, 64, mx::float32)));
  EXPECT_TRUE(hopper_fits(quantized(8, 64, mx::float16)));
}

TEST(Dispatch, RegisterOperandAndTargets) {
  EXPECT_TRUE(use_rs(quantized(4)));
  EXPECT_TRUE(use_rs(quantized(8)));
  EXPECT_FALSE(use_rs(quantized(8, 64, mx::float32))); // fp32 scales: the producer
  EXPECT_FALSE(use_rs(dense()));
  auto producer = quantized(4);
  producer.cfg.tuning.quant_rs = false;
  EXPECT_FALSE(use_rs(producer));
  auto narrow = quantized(4, 32);
  narrow.H = 96;
  EXPECT_TRUE(use_rs(narrow)); // 48-byte packed rows: whole 16-byte units for TMA
  narrow.H = 72;
  EXPECT_FALSE(use_rs(narrow)); // 36 bytes

  EXPECT_TRUE(gathers_targets(true, dense()));
  EXPECT_TRUE(gathers_targets(true, quantized(4)));
  EXPECT_FALSE(gathers_targets(false, dense())); // portable kernels look them up
  auto lookup = dense();
  lookup.cfg.tuning.gather_targets = false;
  EXPECT_FALSE(gathers_targets(true, lookup));
  EXPECT_FALSE(gathers_targets(true, producer)); // the producer's epilogue finds them
}

TEST(Dispatch, VariantsNameKernelsOfTheTable) {
  EXPECT_EQ(variant(dense()), "bf16_dense");
  EXPECT_EQ(variant(dense(mx::float16, mx::float16)), "f16_dense");
  EXPECT_EQ(variant(dense(mx::float32, mx::float32)), "bf16_dense");
  EXPECT_EQ(variant(quantized(8)), "bf16_q8");
  EXPECT_EQ(variant(quantized(3)), "bf16_qany");
  EXPECT_EQ(wg_variant(quantized(4)), "bf16_q4");
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (auto family : {"fwd", "ds", "dh"}) {
      EXPECT_TRUE(in_table(family, variant(quantized(bits)))) << family << bits;
    }
  }
  for (const auto& p : {dense(), dense(mx::float16, mx::float16), quantized(4), quantized(8)}) {
    ASSERT_TRUE(hopper_fits(p));
    for (auto family : {"fwd_wg", "ds_wg", "p_wg", "dh_wg", "target"}) {
      EXPECT_TRUE(in_table(family, wg_variant(p))) << family << wg_variant(p);
    }
    if (use_rs(p)) {
      for (auto family : {"fwd_rs", "p_rs", "dh_rs"}) {
        EXPECT_TRUE(in_table(family, wg_variant(p))) << family << wg_variant(p);
      }
    }
  }
}
