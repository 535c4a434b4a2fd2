// Kernel choices and launch sizes of the head: fields of the primitives'
// configuration, so that is_equivalent (and mx.compile's cache) sees them.
// Zero means "chosen by plan_launch (cuda/plan.h) from the device"; a kernel
// family that is switched off is never used, one that is on is used where the
// head qualifies for it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flash_cce {

struct HeadTuning {
  // CUDA kernel families.
  bool wgmma = true;          // Hopper wgmma kernels (off: the portable mma.sync ones)
  bool quant_rs = true;       // Hopper, 4/8-bit W: W as the register operand
  bool gather_targets = true; // Hopper, dense W: target logits from their own kernel
  // CUDA launch sizes.
  int64_t row_block = 0;   // rows per block of the chunked passes
  int64_t vocab_chunk = 0; // upper bound on the vocabulary chunk width
  int64_t chunk_mb = 0;    // budget (MB) of the [rows, chunk] dS / P buffer
  int64_t fwd_l2_mb = 0;   // L2 budget (MB) for the rows of h a forward group keeps
  int64_t dh_splits = 0;   // most pieces a dh tile of the last round is split into
  // CPU.
  int64_t num_threads = 0; // worker threads

  bool operator==(const HeadTuning&) const = default;
};

// The keys of HeadTuning as the ops' `tuning` argument names them.
const std::vector<std::string>& tuning_keys();

// Sets one field by key: a bool for the kernel families, an integer >= 0 for
// the sizes (0: the default). Throws std::invalid_argument naming the key and
// its allowed values.
void set_tuning(HeadTuning& t, const std::string& key, int64_t value, bool is_bool);

// Every field by key, in tuning_keys() order; flags hold 0 or 1.
struct TuningItem {
  std::string key;
  int64_t value;
  bool flag;
};
std::vector<TuningItem> tuning_items(const HeadTuning& t);

// Raises std::invalid_argument for a negative size.
void check_tuning(const HeadTuning& t);

} // namespace flash_cce
