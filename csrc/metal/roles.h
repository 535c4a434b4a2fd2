// Where each role of the launch plan (plan.h) lives in a primitive's
// evaluation: one of its inputs or outputs, in the order flash_cce.cpp builds
// them, or a scratch buffer of the plan. Pure host code, shared by the Metal
// host (metal_head.cpp) and its tests.
//   forward:  h, w, targets (+ scales, biases)              -> logp, lse (+ gsum)
//   backward: h, w, targets, lse, g, g_lse (+ scales, biases) -> dh (+ dw)
//   fused_dh: gsum, w, targets, logp, lse, g, g_lse (+ scales, biases) -> dh
// With the entropy statistics (`stats`, Problem::stats):
//   forward:  h, w, targets (+ scales, biases) -> logp, lse, entropy, is_top1, mean_logit
//   backward: h, w, targets, lse, g, g_lse, entropy, g_ent (+ scales, biases) -> dh (+ dw)
#pragma once

#include <initializer_list>

#include "plan.h"

namespace flash_cce::metal {

struct Slot {
  enum Kind { missing, input, output, scratch };
  Kind kind = missing;
  int index = -1;
};

inline Slot role_slot(Pass pass, Role role, bool stats = false) {
  using R = Role;
  auto find = [role](Slot::Kind kind, std::initializer_list<Role> order) {
    int i = 0;
    for (Role r : order) {
      if (r == role) {
        return Slot{kind, i};
      }
      ++i;
    }
    return Slot{};
  };
  switch (role) {
    case R::part_max:
    case R::part_sum:
    case R::target_logit:
    case R::part_acc:
    case R::dw_acc:
    case R::stage:
    case R::part_ent:
    case R::part_lsum:
    case R::part_arg:
    case R::h_tile:
    case R::scales_tile:
    case R::biases_tile:
      return {Slot::scratch, -1};
    default:
      break;
  }
  Slot in, out;
  switch (pass) {
    case Pass::forward:
      in = find(Slot::input, {R::h, R::w, R::targets, R::scales, R::biases});
      out = stats ? find(Slot::output, {R::logp, R::lse, R::entropy, R::is_top1, R::mean_logit})
                  : find(Slot::output, {R::logp, R::lse, R::gsum});
      break;
    case Pass::backward:
      in = stats ? find(Slot::input, {R::h, R::w, R::targets, R::lse, R::g, R::g_lse,
                                      R::entropy, R::g_ent, R::scales, R::biases})
                 : find(Slot::input,
                        {R::h, R::w, R::targets, R::lse, R::g, R::g_lse, R::scales, R::biases});
      out = find(Slot::output, {R::dh, R::dw});
      break;
    case Pass::fused_dh:
      in = find(Slot::input, {R::gsum, R::w, R::targets, R::logp, R::lse, R::g, R::g_lse,
                              R::scales, R::biases});
      out = find(Slot::output, {R::dh});
      break;
  }
  return in.kind != Slot::missing ? in : out;
}

} // namespace flash_cce::metal
