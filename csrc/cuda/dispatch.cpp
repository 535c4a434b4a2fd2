#include "dispatch.h"

#include <stdexcept>

#include "cuda_head.h"
#include "entries.h"
#include "loader.h"
#include "mlx/backend/cuda/device.h"
#include "params.h"

namespace flash_cce::cuda {

bool use_wgmma(const mx::Stream& s, const HeadProblem& p) {
  return hopper_fits(p) && mx::cu::device(s.device).compute_capability_major() == 9 &&
      loaded_image(s.device.index).wgmma;
}

bool gathers_targets(const mx::Stream& s, const HeadProblem& p) {
  return gathers_targets(use_wgmma(s, p), p);
}

const char* kernel_name(std::string_view family, std::string_view variant) {
  if (const KernelEntry* e = find_kernel(family, variant)) {
    return e->name;
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
