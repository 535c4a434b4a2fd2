#include "dispatch.h"

#include <stdexcept>

#include "cuda_head.h"
#include "entries.h"
#include "loader.h"
#include "mlx/backend/cuda/device.h"
#include "params.h"

namespace flash_cce::cuda {

bool use_f16(const HeadProblem& p) {
  return p.h_dtype == mx::float16;
}

mx::Dtype compute_dtype(const HeadProblem& p) {
  return use_f16(p) ? mx::float16 : mx::bfloat16;
}

// The Hopper path takes a 16-bit h with 16-byte rows and either a dense W of
// the same type or a 4- or 8-bit one (dequantized by the producer warpgroup).
// Other heads, and tuning.wgmma = false, use the mma.sync kernels.
bool use_wgmma(const mx::Stream& s, const HeadProblem& p) {
  const auto& dev = mx::cu::device(s.device);
  // The Hopper kernels read packed rows as 16-byte vectors and find a column's
  // group with a shift. They dequantize 4-bit codes two at a time with one fma
  // in the operand type, exact only for scales and biases of that type; others
  // (fp16 ones with bf16 h, fp32 ones) take the portable kernels' fp32 fma.
  const int gs = p.cfg.group_size;
  const bool q4_exact = p.cfg.bits != 4 || p.sb_dtype == compute_dtype(p);
  const bool weight_ok = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
      (p.cfg.quantized ? (p.cfg.bits == 4 || p.cfg.bits == 8) && gs >= 32 &&
                             (gs & (gs - 1)) == 0 && q4_exact
                       : p.w_dtype == p.h_dtype);
  return p.cfg.tuning.wgmma && dev.compute_capability_major() == 9 &&
      loaded_image(s.device.index).wgmma && weight_ok &&
      (p.h_dtype == mx::bfloat16 || p.h_dtype == mx::float16) && p.H % 8 == 0 &&
      reinterpret_cast<uintptr_t>(p.h) % 16 == 0;
}

// On Hopper a quantized head's forward, fused P pass and dh take W as the
// register operand (head_wgmma_rs.cuh) unless tuning.quant_rs = false asks for
// the dequantizing producer. TMA needs 16-byte rows of packed words; the
// scales and biases are 16-bit (fp32 ones take the producer).
bool use_rs(const HeadProblem& p) {
  return p.cfg.quantized && p.cfg.tuning.quant_rs &&
      (p.H * p.cfg.bits / 8) % 16 == 0 && (p.sb_dtype == mx::bfloat16 || p.sb_dtype == mx::float16);
}

// Whether the Hopper kernels leave the target logits to gather_targets: the
// register-operand (4/8-bit) ones always, the dense ones unless
// tuning.gather_targets = false.
bool gathers_targets(const mx::Stream& s, const HeadProblem& p) {
  return use_wgmma(s, p) &&
      (use_rs(p) || (!p.cfg.quantized && p.cfg.tuning.gather_targets));
}

std::string variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  if (!p.cfg.quantized) {
    return t + "_dense";
  }
  if (p.cfg.bits == 4 || p.cfg.bits == 8) {
    return t + "_q" + std::to_string(p.cfg.bits);
  }
  return t + "_qany";
}

std::string wg_variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  return t + (p.cfg.quantized ? "_q" + std::to_string(p.cfg.bits) : "_dense");
}

const char* kernel_name(std::string_view family, std::string_view variant) {
  for (const auto& e : kKernelEntries) {
    if (family == e.family && variant == e.variant) {
      return e.name;
    }
  }
  throw std::logic_error("[flash_cce] no kernel " + std::string(family) + " for " +
                         std::string(variant));
}

int64_t stats_tile_width(bool wgmma, bool rs) {
  return !wgmma ? kTileN : rs ? kRsTileV : kWgTileN;
}

LaunchPlan launch_plan(const mx::Stream& s, const HeadProblem& p) {
  return plan_launch(p.cfg.tuning, device_info(s.device.index));
}

std::vector<std::pair<std::string, int64_t>> launch_plan_items(int ordinal,
                                                               const HeadTuning& tuning) {
  const DeviceInfo d = device_info(ordinal);
  const LaunchPlan plan = plan_launch(tuning, d);
  return {{"sms", d.sms},
          {"l2_bytes", d.l2_bytes},
          {"row_block", plan.row_block},
          {"chunk_bytes", plan.chunk_bytes},
          {"vocab_chunk", plan.vocab_chunk},
          {"fwd_l2_bytes", plan.fwd_l2_bytes},
          {"dh_splits", plan.dh_splits}};
}

} // namespace flash_cce::cuda
