// How the Metal host binds the plan's roles (csrc/metal/roles.h) to arrays:
// every role a plan binds resolves to an input or output the evaluation has,
// or to one of the plan's scratch buffers; every output is written by some
// launch; and each input position holds what its role names, checked against
// the primitives that flash_cce.cpp actually builds (distinct values per role).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "flash_cce.h"
#include "metal/roles.h"
#include "mlx/ops.h"
#include "mlx/random.h"
#include "mlx/transforms.h"

using namespace flash_cce::metal;
namespace fc = flash_cce;
namespace mx = mlx::core;

namespace {

// Inputs and outputs of each primitive (flash_cce.h).
int inputs_of(Pass pass, bool quantized, bool stats) {
  const int base = pass == Pass::forward ? 3 : pass == Pass::backward ? 6 : 7;
  return base + (quantized ? 2 : 0) + (stats && pass == Pass::backward ? 2 : 0);
}

int outputs_of(const Problem& p) {
  if (p.pass == Pass::forward) {
    return p.stats ? 5 : p.fused ? 3 : 2;
  }
  return p.pass == Pass::backward && p.compute_dw ? 2 : 1;
}

std::vector<Problem> problems() {
  std::vector<Problem> out;
  for (Pass pass : {Pass::forward, Pass::backward, Pass::fused_dh}) {
    for (bool quantized : {false, true}) {
      for (auto [M, V] : {std::pair{1, 131}, std::pair{300, 1733}, std::pair{8, 8230}}) {
        for (bool flag : {false, true}) { // forward: fused; backward: compute_dw
          Problem p;
          p.pass = pass;
          p.M = M, p.H = 256, p.V = V;
          p.h = p.out = DType::bf16;
          p.w = p.sb = DType::bf16;
          p.quantized = quantized;
          p.fused = pass == Pass::forward && flag;
          p.compute_dw = pass == Pass::backward && flag && !quantized;
          out.push_back(p);
          if (pass != Pass::fused_dh && !p.fused) { // the entropy statistics
            p.stats = true;
            out.push_back(p);
          }
        }
      }
    }
  }
  return out;
}

TEST(MetalRoles, EveryBoundRoleResolves) {
  for (const Problem& p : problems()) {
    const Plan plan = make_plan(p);
    std::set<Role> scratch;
    for (const auto& s : plan.scratch) {
      scratch.insert(s.role);
    }
    std::set<int> written;
    for (const Launch& l : plan.launches) {
      for (const Binding& b : l.buffers) {
        const Slot slot = role_slot(p.pass, b.role, p.stats);
        const std::string where = std::string(l.kernel) + " binds " + role_name(b.role);
        switch (slot.kind) {
          case Slot::input:
            EXPECT_LT(slot.index, inputs_of(p.pass, p.quantized, p.stats)) << where;
            break;
          case Slot::output:
            EXPECT_LT(slot.index, outputs_of(p)) << where;
            written.insert(slot.index);
            break;
          case Slot::scratch:
            EXPECT_TRUE(scratch.count(b.role)) << where << " without allocating it";
            break;
          case Slot::missing:
            EXPECT_TRUE(false) << where << ", which the primitive does not have";
        }
      }
    }
    EXPECT_EQ(int(written.size()), outputs_of(p))
        << "an output no launch writes, pass " << int(p.pass);
  }
}

// The array flash_cce.cpp built with primitive `name` under `a` (the ops
// reshape a primitive's outputs, and transforms may wrap them).
mx::array find_primitive(mx::array a, const std::string& name) {
  for (int depth = 0; depth < 6; ++depth) {
    if (a.has_primitive() && name == a.primitive().name()) {
      return a;
    }
    if (a.inputs().empty()) {
      break;
    }
    a = a.inputs()[0];
  }
  throw std::runtime_error("no " + name + " primitive in the graph");
}

bool all_equal(const mx::array& a, float v) {
  return mx::all(mx::equal(mx::astype(a, mx::float32), mx::array(v))).item<bool>();
}

struct Head {
  mx::array h, w, targets, scales, biases;
};

Head quantized_head(int M, int H, int V) {
  auto h = mx::astype(mx::random::normal({M, H}), mx::bfloat16);
  auto w = mx::astype(mx::random::normal({V, H}), mx::bfloat16);
  auto q = mx::quantize(w, 64, 4);
  // Distinct constants, so that each input can be told apart.
  auto scales = mx::full(q[1].shape(), 0.5f, q[1].dtype());
  auto biases = mx::full(q[2].shape(), -0.25f, q[2].dtype());
  auto y = mx::astype(mx::arange(M), mx::int32);
  return {h, q[0], y, scales, biases};
}

void expect_role(const mx::array& prim, Pass pass, Role role, float value, bool stats = false) {
  const Slot s = role_slot(pass, role, stats);
  ASSERT_EQ(s.kind, Slot::input) << role_name(role);
  EXPECT_TRUE(all_equal(prim.inputs().at(s.index), value)) << role_name(role);
}

TEST(MetalRoles, InputPositionsMatchThePrimitives) {
  mx::set_default_device(mx::Device::cpu);
  const int M = 5, H = 128, V = 40;
  Head k = quantized_head(M, H, V);
  auto lse = mx::full({M}, 1.0f);
  auto g = mx::full({M}, 2.0f);
  auto g_lse = mx::full({M}, 3.0f);

  // Forward: h, w, targets, scales, biases.
  auto fwd = fc::flash_cce_forward(k.h, k.w, k.targets, k.scales, k.biases, 64, 4,
                                   std::nullopt, -100, true);
  auto pf = find_primitive(fwd[0], "FlashCCEForward");
  EXPECT_EQ(pf.inputs().at(role_slot(Pass::forward, Role::h).index).dtype(), mx::bfloat16);
  EXPECT_EQ(pf.inputs().at(role_slot(Pass::forward, Role::w).index).dtype(), mx::uint32);
  EXPECT_EQ(pf.inputs().at(role_slot(Pass::forward, Role::targets).index).dtype(), mx::int32);
  expect_role(pf, Pass::forward, Role::scales, 0.5f);
  expect_role(pf, Pass::forward, Role::biases, -0.25f);
  const int fwd_outputs = static_cast<int>(pf.outputs().size());
  EXPECT_EQ(fwd_outputs, 3); // fused on the CPU: logp, lse, gsum
  EXPECT_EQ(role_slot(Pass::forward, Role::gsum).index, 2);

  // Backward: h, w, targets, lse, g, g_lse, scales, biases.
  auto bwd = fc::flash_cce_backward(k.h, k.w, k.targets, lse, g, g_lse, k.scales, k.biases,
                                    64, 4, std::nullopt, -100, false);
  auto pb = find_primitive(bwd[0], "FlashCCEBackward");
  EXPECT_EQ(pb.inputs().at(role_slot(Pass::backward, Role::h).index).dtype(), mx::bfloat16);
  expect_role(pb, Pass::backward, Role::lse, 1.0f);
  expect_role(pb, Pass::backward, Role::g, 2.0f);
  expect_role(pb, Pass::backward, Role::g_lse, 3.0f);
  expect_role(pb, Pass::backward, Role::scales, 0.5f);
  expect_role(pb, Pass::backward, Role::biases, -0.25f);

  // With the entropy: h, w, targets, lse, g, g_lse, entropy, g_ent, scales,
  // biases -> dh; the forward's outputs logp, lse, entropy, is_top1, mean_logit.
  auto ent = mx::full({M}, 4.0f);
  auto g_ent = mx::full({M}, 5.0f);
  auto bwd_ent = fc::flash_cce_backward(k.h, k.w, k.targets, lse, g, g_lse, k.scales,
                                        k.biases, 64, 4, std::nullopt, -100, false, {}, {},
                                        ent, g_ent);
  auto pe = find_primitive(bwd_ent[0], "FlashCCEBackward");
  const std::pair<Role, float> roles[] = {
      {Role::lse, 1.0f}, {Role::g, 2.0f}, {Role::g_lse, 3.0f}, {Role::entropy, 4.0f},
      {Role::g_ent, 5.0f}, {Role::scales, 0.5f}, {Role::biases, -0.25f}};
  for (auto [role, value] : roles) {
    expect_role(pe, Pass::backward, role, value, true);
  }
  auto fwd_ent = fc::flash_cce_forward(k.h, k.w, k.targets, k.scales, k.biases, 64, 4,
                                       std::nullopt, -100, false, {}, {}, true);
  ASSERT_EQ(fwd_ent.size(), 5u);
  EXPECT_EQ(role_slot(Pass::forward, Role::is_top1, true).index, 3);
  EXPECT_EQ(fwd_ent[3].dtype(), mx::bool_);
  EXPECT_EQ(role_slot(Pass::forward, Role::entropy, true).index, 2);
  EXPECT_EQ(role_slot(Pass::forward, Role::mean_logit, true).index, 4);
  // The outputs in that order: the entropy and mean logit of the logits.
  auto wd = mx::dequantize(k.w, k.scales, k.biases, 64, 4);
  auto s = mx::matmul(mx::astype(k.h, mx::float32), mx::transpose(mx::astype(wd, mx::float32)));
  auto p = mx::softmax(s, -1);
  auto want_ent = mx::subtract(mx::logsumexp(s, -1), mx::sum(mx::multiply(p, s), -1));
  EXPECT_TRUE(mx::allclose(fwd_ent[2], want_ent, 1e-3, 1e-3).item<bool>());
  EXPECT_TRUE(mx::allclose(fwd_ent[4], mx::mean(s, -1), 1e-3, 1e-3).item<bool>());

  // Fused dh, from the forward's VJP: gsum, w, targets, logp, lse, g, g_lse, scales, biases.
  auto f = [&](const std::vector<mx::array>& x) {
    return fc::flash_cce_forward(x[0], k.w, k.targets, k.scales, k.biases, 64, 4,
                                 std::nullopt, -100, true);
  };
  auto [outs, grads] = mx::vjp(f, {k.h}, {g, g_lse});
  auto pd = find_primitive(grads[0], "FlashCCEFusedDh");
  const auto& gsum = pd.inputs().at(role_slot(Pass::fused_dh, Role::gsum).index);
  EXPECT_EQ(gsum.dtype(), mx::float32);
  EXPECT_TRUE(gsum.shape() == (mx::Shape{M, H}));
  expect_role(pd, Pass::fused_dh, Role::g, 2.0f);
  expect_role(pd, Pass::fused_dh, Role::g_lse, 3.0f);
  expect_role(pd, Pass::fused_dh, Role::scales, 0.5f);
  expect_role(pd, Pass::fused_dh, Role::biases, -0.25f);
  // logp <= 0 < lse here: the two row-wise forward outputs are not swapped.
  auto logp = pd.inputs().at(role_slot(Pass::fused_dh, Role::logp).index);
  auto lse_in = pd.inputs().at(role_slot(Pass::fused_dh, Role::lse).index);
  EXPECT_TRUE(mx::allclose(logp, outs[0]).item<bool>());
  EXPECT_TRUE(mx::allclose(lse_in, outs[1]).item<bool>());
  EXPECT_FALSE(mx::allclose(logp, lse_in).item<bool>());
}

} // namespace
