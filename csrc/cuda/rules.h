// Which kernel family a head qualifies for and the variant suffixes of the
// kernels' names: plain host functions of the problem (tested in
// tests/cpp/test_dispatch.cpp); dispatch.cpp adds what the GPU says.
#pragma once

#include <cstdint>
#include <string>

#include "../head_kernels.h"

namespace flash_cce::cuda {

// Tensor-core operand type: fp16 when h is fp16, else bf16 (fp32 operands are
// rounded to bf16 in the loaders; accumulation is always fp32).
inline bool use_f16(const HeadProblem& p) {
  return p.h_dtype == mx::float16;
}

inline mx::Dtype compute_dtype(const HeadProblem& p) {
  return use_f16(p) ? mx::float16 : mx::bfloat16;
}

// Whether p may take the Hopper kernels (on an sm_90a image): a 16-bit h with
// 16-byte rows and either a dense W of the same type or a 4- or 8-bit one,
// unless tuning.wgmma is off. The Hopper kernels read packed rows as 16-byte
// vectors and find a column's group with a shift. They dequantize 4-bit codes
// two at a time with one fma in the operand type, exact only for scales and
// biases of that type; others (fp16 ones with bf16 h, fp32 ones) take the
// portable kernels' fp32 fma.
inline bool hopper_fits(const HeadProblem& p) {
  const int gs = p.cfg.group_size;
  const bool q4_exact = p.cfg.bits != 4 || p.sb_dtype == compute_dtype(p);
  const bool weight_ok = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
      (p.cfg.quantized ? (p.cfg.bits == 4 || p.cfg.bits == 8) && gs >= 32 &&
                             (gs & (gs - 1)) == 0 && q4_exact
                       : p.w_dtype == p.h_dtype);
  return p.cfg.tuning.wgmma && weight_ok &&
      (p.h_dtype == mx::bfloat16 || p.h_dtype == mx::float16) && p.H % 8 == 0 &&
      reinterpret_cast<uintptr_t>(p.h) % 16 == 0;
}

// On Hopper a quantized head's forward, fused P pass and dh take W as the
// register operand (head_wgmma_rs.cuh) unless tuning.quant_rs = false asks for
// the dequantizing producer. TMA needs 16-byte rows of packed words; the
// scales and biases are 16-bit (fp32 ones take the producer).
inline bool use_rs(const HeadProblem& p) {
  return p.cfg.quantized && p.cfg.tuning.quant_rs && (p.H * p.cfg.bits / 8) % 16 == 0 &&
      (p.sb_dtype == mx::bfloat16 || p.sb_dtype == mx::float16);
}

// Whether the Hopper kernels (wgmma: p runs them) leave the target logits to
// fcce_target_*: the register-operand (4/8-bit) ones always, the dense ones
// unless tuning.gather_targets = false.
inline bool gathers_targets(bool wgmma, const HeadProblem& p) {
  return wgmma && (use_rs(p) || (!p.cfg.quantized && p.cfg.tuning.gather_targets));
}

// Kernel name variant of the portable kernels: compute type and weight loader.
inline std::string variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  if (!p.cfg.quantized) {
    return t + "_dense";
  }
  if (p.cfg.bits == 4 || p.cfg.bits == 8) {
    return t + "_q" + std::to_string(p.cfg.bits);
  }
  return t + "_qany";
}

// Variant of a Hopper kernel: compute type and how B reaches shared memory.
inline std::string wg_variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  return t + (p.cfg.quantized ? "_q" + std::to_string(p.cfg.bits) : "_dense");
}

} // namespace flash_cce::cuda
