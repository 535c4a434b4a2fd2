#include "flash_cce.h"

#include <cmath>
#include <stdexcept>

#include "head_kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#if defined(FLASH_CCE_CUDA)
#include "cuda/cuda_head.h"
#elif defined(FLASH_CCE_METAL)
#include "metal/metal_head.h"
#endif

namespace flash_cce {

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[flash_cce] " + msg);
}

// Messages are built without iostreams: formatting an integer through an
// ostringstream crashed in one build environment (a C++ runtime mismatch).
std::string shape_str(const mx::Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    out += std::to_string(s[i]) + (i + 1 < s.size() ? ", " : "");
  }
  return out + (s.size() == 1 ? ",)" : ")");
}

std::string dtype_str(mx::Dtype t) {
  static const std::pair<mx::Dtype, const char*> names[] = {
      {mx::bool_, "bool"},       {mx::uint8, "uint8"},     {mx::uint16, "uint16"},
      {mx::uint32, "uint32"},    {mx::uint64, "uint64"},   {mx::int8, "int8"},
      {mx::int16, "int16"},      {mx::int32, "int32"},     {mx::int64, "int64"},
      {mx::float16, "float16"},  {mx::float32, "float32"}, {mx::float64, "float64"},
      {mx::bfloat16, "bfloat16"}, {mx::complex64, "complex64"}};
  for (const auto& [dtype, name] : names) {
    if (dtype == t) {
      return name;
    }
  }
  return "an unknown dtype";
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::bfloat16 || t == mx::float16;
}

bool is_integer(mx::Dtype t) {
  return mx::issubdtype(t, mx::integer);
}

mx::Shape lead_shape(const mx::array& h) {
  return mx::Shape(h.shape().begin(), h.shape().end() - 1);
}

int64_t rows(const mx::array& h) {
  return h.ndim() == 0 ? 0 : h.size() / h.shape().back();
}

void check_rowwise(const mx::array& a, const mx::Shape& lead, const char* name) {
  if (a.shape() != lead) {
    fail(std::string(name) + " must have shape " + shape_str(lead) +
         " (h.shape[:-1]), got " + shape_str(a.shape()));
  }
  if (!is_float(a.dtype())) {
    fail(std::string(name) + " must be a floating dtype, got " +
         dtype_str(a.dtype()));
  }
}

} // namespace

HeadConfig check_head_args(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    std::optional<int> bits,
    std::optional<float> softcap,
    int ignore_index) {
  HeadConfig cfg;
  cfg.ignore_index = ignore_index;
  if (h.ndim() < 1) {
    fail("h must have shape (..., H), got a scalar");
  }
  if (!is_float(h.dtype())) {
    fail("h must be float32, bfloat16 or float16, got " + dtype_str(h.dtype()));
  }
  const int64_t H = h.shape().back();
  if (H < 1) {
    fail("h must have a non-empty last (hidden) dimension, got shape " +
         shape_str(h.shape()));
  }
  if (w.ndim() != 2) {
    fail("w must be a 2-D [V, H] head weight, got shape " + shape_str(w.shape()));
  }
  const int64_t V = w.shape(0);
  if (V < 1) {
    fail("w must have at least one vocabulary row, got shape " +
         shape_str(w.shape()));
  }
  if (V > INT32_MAX) {
    fail("w has more than 2^31 - 1 vocabulary rows");
  }
  if (targets.shape() != lead_shape(h)) {
    fail("targets must have shape " + shape_str(lead_shape(h)) +
         " (h.shape[:-1]), got " + shape_str(targets.shape()));
  }
  if (!is_integer(targets.dtype())) {
    fail("targets must be an integer array, got " + dtype_str(targets.dtype()));
  }
  if (softcap) {
    if (!(*softcap > 0.0f) || !std::isfinite(*softcap)) {
      fail("softcap must be a finite positive number or None, got " +
           std::to_string(*softcap));
    }
    cfg.softcap = *softcap;
  }

  if (scales.has_value() != biases.has_value()) {
    fail("scales and biases must be given together (MLX affine quantization)");
  }
  if (!scales) {
    if (!is_float(w.dtype())) {
      fail("a dense w must be float32, bfloat16 or float16, got " +
           dtype_str(w.dtype()) + " (pass scales and biases for a quantized w)");
    }
    if (w.shape(1) != H) {
      fail("w must have shape (V, " + std::to_string(H) + ") to match h, got " +
           shape_str(w.shape()));
    }
    if (bits) {
      fail("bits was given but w is dense (scales is None)");
    }
    return cfg;
  }

  cfg.quantized = true;
  if (w.dtype() != mx::uint32) {
    fail("a quantized w must be packed uint32 (mx.quantize), got " +
         dtype_str(w.dtype()));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (H % group_size != 0) {
    fail("hidden size " + std::to_string(H) + " is not a multiple of group_size " +
         std::to_string(group_size));
  }
  // The packed width fixes the bit width: w.shape[1] * 32 == H * bits.
  const int64_t packed_bits = int64_t(w.shape(1)) * 32;
  if (packed_bits % H != 0) {
    fail("packed w of shape " + shape_str(w.shape()) +
         " does not hold a whole number of bits per element for H=" +
         std::to_string(H));
  }
  const int inferred = static_cast<int>(packed_bits / H);
  if (bits && *bits != inferred) {
    fail("bits=" + std::to_string(*bits) + " does not match the packed w " +
         shape_str(w.shape()) + " for H=" + std::to_string(H) + " (that is " +
         std::to_string(inferred) + "-bit)");
  }
  if (inferred < 2 || inferred > 8 || inferred == 7) {
    fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(inferred));
  }
  const mx::Shape sb_shape{static_cast<int>(V), static_cast<int>(H / group_size)};
  for (auto [a, name] : {std::pair{&*scales, "scales"}, std::pair{&*biases, "biases"}}) {
    if (a->shape() != sb_shape) {
      fail(std::string(name) + " must have shape " + shape_str(sb_shape) +
           " for w " + shape_str(w.shape()) + ", H=" + std::to_string(H) +
           " and group_size=" + std::to_string(group_size) + ", got " +
           shape_str(a->shape()));
    }
    if (!is_float(a->dtype())) {
      fail(std::string(name) + " must be a floating dtype, got " +
           dtype_str(a->dtype()));
    }
  }
  if (scales->dtype() != biases->dtype()) {
    fail("scales and biases must share a dtype, got " +
         dtype_str(scales->dtype()) + " and " + dtype_str(biases->dtype()));
  }
  cfg.bits = inferred;
  cfg.group_size = group_size;
  return cfg;
}

namespace {

// The arrays the primitives consume: 2-D h, int32 targets, contiguous.
std::vector<mx::array> head_inputs(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    mx::StreamOrDevice s) {
  const int H = h.shape().back();
  std::vector<mx::array> in{
      mx::contiguous(mx::reshape(h, {-1, H}, s), false, s),
      mx::contiguous(w, false, s),
      mx::contiguous(mx::astype(mx::flatten(targets, s), mx::int32, s), false, s)};
  if (scales) {
    in.push_back(mx::contiguous(*scales, false, s));
    in.push_back(mx::contiguous(*biases, false, s));
  }
  return in;
}

mx::array rowwise(const mx::array& a, mx::StreamOrDevice s) {
  return mx::contiguous(mx::astype(mx::flatten(a, s), mx::float32, s), false, s);
}

} // namespace

namespace {

// The forward primitive's outputs: logp, lse (+ entropy, is_top1, mean_logit)
// (+ gsum (+ gsum_ent)); the first fused output is at fused_at(cfg).
size_t fused_at(const HeadConfig& cfg) {
  return cfg.stats ? 5 : 2;
}

std::vector<mx::Shape> forward_shapes(const HeadConfig& cfg, int M, int H) {
  std::vector<mx::Shape> shapes(fused_at(cfg), mx::Shape{M});
  if (cfg.fused) {
    shapes.push_back({M, H});
    if (cfg.stats) {
      shapes.push_back({M, H});
    }
  }
  return shapes;
}

// All outputs of the forward primitive, with h's leading shape restored.
std::vector<mx::array> forward_outputs(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    HeadConfig cfg,
    mx::Stream stream) {
  const auto lead = lead_shape(h);
  auto in = head_inputs(h, w, targets, scales, biases, stream);
  const int M = in[0].shape(0);
  const int H = in[0].shape(1);
  auto shapes = forward_shapes(cfg, M, H);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  if (cfg.stats) {
    dtypes[3] = mx::bool_;
  }
  auto out = mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<FlashCCEForward>(stream, cfg), std::move(in));
  for (size_t i = 0; i < out.size(); ++i) {
    auto shape = lead;
    if (out[i].ndim() == 2) {
      shape.push_back(H);
    }
    out[i] = mx::reshape(out[i], shape, stream);
  }
  return out;
}

} // namespace

std::vector<mx::array> flash_cce_forward(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    std::optional<int> bits,
    std::optional<float> softcap,
    int ignore_index,
    bool fused_backward,
    const HeadTuning& tuning,
    mx::StreamOrDevice s,
    bool stats) {
  auto cfg = check_head_args(
      h, w, targets, scales, biases, group_size, bits, softcap, ignore_index);
  check_tuning(tuning);
  cfg.tuning = tuning;
  cfg.stats = stats;
  auto stream = mx::to_stream(s);
  if (stats && !supports_stats(stream.device)) {
    fail("the entropy statistics have no native kernel on this device; use backend='fallback'");
  }
  const auto lead = lead_shape(h);
  if (rows(h) == 0) {
    std::vector<mx::array> out(fused_at(cfg), mx::zeros(lead, mx::float32, s));
    if (stats) {
      out[3] = mx::zeros(lead, mx::bool_, s);
    }
    return out;
  }
  cfg.fused = fused_backward && supports_fused(stream, h.dtype(), stats);
  auto out = forward_outputs(h, w, targets, scales, biases, cfg, stream);
  out.erase(out.begin() + fused_at(cfg), out.end());
  return out;
}

std::vector<mx::array> flash_cce_backward(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const mx::array& lse,
    const mx::array& g,
    const std::optional<mx::array>& g_lse,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    std::optional<int> bits,
    std::optional<float> softcap,
    int ignore_index,
    bool compute_dw,
    const HeadTuning& tuning,
    mx::StreamOrDevice s,
    const std::optional<mx::array>& entropy,
    const std::optional<mx::array>& g_entropy) {
  auto cfg = check_head_args(
      h, w, targets, scales, biases, group_size, bits, softcap, ignore_index);
  check_tuning(tuning);
  cfg.tuning = tuning;
  if (entropy.has_value() != g_entropy.has_value()) {
    fail("g_entropy and entropy (the forward's output) must be given together");
  }
  cfg.stats = g_entropy.has_value();
  if (compute_dw && cfg.quantized) {
    fail("compute_dw needs a dense w: a quantized head is frozen");
  }
  const auto lead = lead_shape(h);
  check_rowwise(lse, lead, "lse");
  check_rowwise(g, lead, "g");
  if (g_lse) {
    check_rowwise(*g_lse, lead, "g_lse");
  }
  if (cfg.stats) {
    check_rowwise(*entropy, lead, "entropy");
    check_rowwise(*g_entropy, lead, "g_entropy");
    if (!supports_stats(mx::to_stream(s).device)) {
      fail("the entropy's gradient has no native kernel on this device; use backend='fallback'");
    }
  }
  if (rows(h) == 0) {
    std::vector<mx::array> out{mx::zeros_like(h, s)};
    if (compute_dw) {
      out.push_back(mx::zeros_like(w, s));
    }
    return out;
  }
  auto stream = mx::to_stream(s);
  auto in = head_inputs(h, w, targets, scales, biases, stream);
  const int M = in[0].shape(0);
  const int H = in[0].shape(1);
  auto g_lse_flat =
      g_lse ? rowwise(*g_lse, stream) : mx::zeros({M}, mx::float32, stream);
  // Order: h, w, targets, lse, g, g_lse (+ entropy, g_entropy) (+ scales, biases).
  in.insert(in.begin() + 3, {rowwise(lse, stream), rowwise(g, stream), g_lse_flat});
  if (cfg.stats) {
    in.insert(in.begin() + 6, {rowwise(*entropy, stream), rowwise(*g_entropy, stream)});
  }
  std::vector<mx::Shape> shapes{{M, H}};
  std::vector<mx::Dtype> dtypes{h.dtype()};
  if (compute_dw) {
    shapes.push_back(w.shape());
    dtypes.push_back(w.dtype());
  }
  auto out = mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<FlashCCEBackward>(stream, cfg, compute_dw), std::move(in));
  out[0] = mx::reshape(out[0], h.shape(), s);
  return out;
}

// Transforms ------------------------------------------------------------------

namespace {

std::optional<mx::array> opt_input(const std::vector<mx::array>& in, size_t i) {
  return in.size() > i ? std::optional<mx::array>(in[i]) : std::nullopt;
}

std::optional<float> opt_cap(const HeadConfig& cfg) {
  return cfg.softcap > 0 ? std::optional<float>(cfg.softcap) : std::nullopt;
}

std::optional<int> opt_bits(const HeadConfig& cfg) {
  return cfg.quantized ? std::optional<int>(cfg.bits) : std::nullopt;
}

// Moves the vmapped axis of each row-wise input to the front and broadcasts the
// unbatched ones. The head weight may not be batched.
void batch_front(std::vector<mx::array>& in, const std::vector<int>& axes,
                 const std::vector<size_t>& rowwise, const char* who) {
  for (size_t i = 0; i < in.size(); ++i) {
    bool is_row = std::find(rowwise.begin(), rowwise.end(), i) != rowwise.end();
    if (!is_row && axes[i] >= 0) {
      throw std::invalid_argument(
          std::string("[flash_cce] vmap of ") + who +
          " over the head weight (w, scales, biases) is not supported");
    }
  }
  int batch = -1;
  for (size_t i : rowwise) {
    if (axes[i] >= 0) {
      in[i] = mx::moveaxis(in[i], axes[i], 0);
      batch = in[i].shape(0);
    }
  }
  for (size_t i : rowwise) {
    if (axes[i] < 0) {
      auto shape = in[i].shape();
      shape.insert(shape.begin(), batch);
      in[i] = mx::broadcast_to(mx::expand_dims(in[i], 0), shape);
    }
  }
}

// dh = g dcap_y W_y + (g_lse - g) gsum, with gsum = sum_v p_v dcap_v W_v from
// the forward and dcap_y = 1 - (s_y / cap)^2 recovered from s_y = logp + lse.
// Inputs: gsum, w, targets, logp, lse, g, g_lse (+ scales, biases); the
// row-wise ones may carry any leading shape (vmap), gsum ends in H.
mx::array fused_dh(const std::vector<mx::array>& in, mx::Dtype out_dtype,
                   const HeadConfig& cfg, mx::Stream s) {
  const auto& gsum = in[0];
  const int H = gsum.shape().back();
  std::vector<mx::array> flat{
      mx::contiguous(mx::reshape(gsum, {-1, H}, s), false, s),
      mx::contiguous(in[1], false, s),
      mx::contiguous(mx::astype(mx::flatten(in[2], s), mx::int32, s), false, s)};
  for (size_t i = 3; i < 7; ++i) {
    flat.push_back(rowwise(in[i], s));
  }
  size_t rest = 7;
  if (cfg.stats) {
    flat.push_back(mx::contiguous(mx::reshape(in[7], {-1, H}, s), false, s));
    flat.push_back(rowwise(in[8], s));
    rest = 9;
  }
  for (size_t i = rest; i < in.size(); ++i) {
    flat.push_back(mx::contiguous(in[i], false, s));
  }
  auto shape = flat[0].shape();
  auto dh = mx::array(std::move(shape), out_dtype,
                      std::make_shared<FlashCCEFusedDh>(s, cfg, out_dtype), std::move(flat));
  return mx::reshape(dh, gsum.shape(), s);
}

} // namespace

std::vector<mx::array> FlashCCEForward::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  const auto& h = primals[0];
  const auto& w = primals[1];
  const auto& targets = primals[2];
  auto s = stream();
  const mx::array g = cotangents.size() > 0 ? cotangents[0] : mx::zeros_like(outputs[0], s);
  const mx::array g_lse = cotangents.size() > 1 ? cotangents[1] : mx::zeros_like(outputs[1], s);
  // The entropy's cotangent; is_top1 and the mean logit are statistics.
  std::optional<mx::array> entropy, g_ent;
  if (cfg_.stats) {
    entropy = outputs[2];
    g_ent = cotangents.size() > 2 ? cotangents[2] : mx::zeros_like(outputs[2], s);
  }

  bool want_dw = false;
  for (int a : argnums) {
    want_dw |= (a == 1 && !cfg_.quantized);
  }
  std::vector<mx::array> grads;
  if (cfg_.fused && !want_dw) {
    const size_t at = fused_at(cfg_);
    std::vector<mx::array> in{outputs[at], w, targets, outputs[0], outputs[1], g, g_lse};
    if (cfg_.stats) {
      in.push_back(outputs[at + 1]);
      in.push_back(*g_ent);
    }
    for (size_t i = 3; i < primals.size(); ++i) {
      in.push_back(primals[i]);
    }
    grads = {fused_dh(in, h.dtype(), cfg_, s)};
  } else {
    grads = flash_cce_backward(
      h, w, targets, outputs[1], g, g_lse, opt_input(primals, 3),
      opt_input(primals, 4), cfg_.group_size, opt_bits(cfg_), opt_cap(cfg_),
      cfg_.ignore_index, want_dw, cfg_.tuning, s, entropy, g_ent);
  }

  // Integer targets and a frozen quantized head get zero cotangents.
  std::vector<mx::array> result;
  for (int a : argnums) {
    if (a == 0) {
      result.push_back(grads[0]);
    } else if (a == 1 && want_dw) {
      result.push_back(grads[1]);
    } else {
      result.push_back(mx::zeros_like(primals[a], s));
    }
  }
  return result;
}

std::pair<std::vector<mx::array>, std::vector<int>> FlashCCEForward::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto in = inputs;
  batch_front(in, axes, {0, 2}, "flash_cce_forward");
  auto out = forward_outputs(
      in[0], in[1], in[2], opt_input(in, 3), opt_input(in, 4), cfg_, stream());
  return {out, std::vector<int>(out.size(), 0)};
}

std::vector<mx::Shape> FlashCCEForward::output_shapes(
    const std::vector<mx::array>& inputs) {
  return forward_shapes(cfg_, inputs[0].shape(0), inputs[0].shape(1));
}

bool FlashCCEForward::is_equivalent(const mx::Primitive& other) const {
  return cfg_ == static_cast<const FlashCCEForward&>(other).cfg_;
}

std::pair<std::vector<mx::array>, std::vector<int>> FlashCCEBackward::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  if (compute_dw_) {
    throw std::invalid_argument(
        "[flash_cce] vmap of the backward with dw (per-example weight gradients) "
        "is not supported");
  }
  auto in = inputs;
  const size_t at = cfg_.stats ? 8 : 6; // scales
  std::vector<size_t> rowwise_at{0, 2, 3, 4, 5};
  std::optional<mx::array> entropy, g_ent;
  if (cfg_.stats) {
    rowwise_at.insert(rowwise_at.end(), {6, 7});
  }
  batch_front(in, axes, rowwise_at, "flash_cce_backward");
  if (cfg_.stats) {
    entropy = in[6];
    g_ent = in[7];
  }
  auto out = flash_cce_backward(
      in[0], in[1], in[2], in[3], in[4], in[5], opt_input(in, at),
      opt_input(in, at + 1), cfg_.group_size, opt_bits(cfg_), opt_cap(cfg_),
      cfg_.ignore_index, false, cfg_.tuning, stream(), entropy, g_ent);
  return {out, {0}};
}

std::vector<mx::Shape> FlashCCEBackward::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out{inputs[0].shape()};
  if (compute_dw_) {
    out.push_back(inputs[1].shape());
  }
  return out;
}

bool FlashCCEBackward::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FlashCCEBackward&>(other);
  return cfg_ == o.cfg_ && compute_dw_ == o.compute_dw_;
}

std::pair<std::vector<mx::array>, std::vector<int>> FlashCCEFusedDh::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto in = inputs;
  std::vector<size_t> rowwise_at{0, 2, 3, 4, 5, 6};
  if (cfg_.stats) {
    rowwise_at.insert(rowwise_at.end(), {7, 8});
  }
  batch_front(in, axes, rowwise_at, "the fused backward");
  return {{fused_dh(in, out_dtype_, cfg_, stream())}, {0}};
}

bool FlashCCEFusedDh::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FlashCCEFusedDh&>(other);
  return cfg_ == o.cfg_ && out_dtype_ == o.out_dtype_;
}

// Evaluation ------------------------------------------------------------------

namespace {

HeadProblem make_problem(const std::vector<mx::array>& in, const HeadConfig& cfg) {
  HeadProblem p;
  p.cfg = cfg;
  p.M = in[0].shape(0);
  p.H = in[0].shape(1);
  p.V = in[1].shape(0);
  p.h_dtype = in[0].dtype();
  p.w_dtype = in[1].dtype();
  return p;
}

void set_cpu_pointers(HeadProblem& p, const std::vector<mx::array>& in,
                      size_t scales_at) {
  p.h = in[0].data<void>();
  p.w = in[1].data<void>();
  p.targets = in[2].data<int32_t>();
  if (p.cfg.quantized) {
    p.scales = in[scales_at].data<void>();
    p.biases = in[scales_at + 1].data<void>();
    p.sb_dtype = in[scales_at].dtype();
  }
}

using Arrays = std::vector<mx::array>;

// Allocates the outputs and queues run(problem, inputs, outputs) on the CPU
// stream; the lambda keeps the arrays alive until it has run.
template <class F>
void dispatch_cpu(mx::Stream stream, const HeadConfig& cfg, size_t scales_at,
                  const std::vector<mx::array>& inputs,
                  std::vector<mx::array>& outputs, F run) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  for (auto& a : outputs) {
    enc.set_output_array(a);
  }
  enc.dispatch([in = inputs, out = outputs, cfg, scales_at, run]() mutable {
    auto p = make_problem(in, cfg);
    set_cpu_pointers(p, in, scales_at);
    run(p, in, out);
  });
}

} // namespace

void FlashCCEForward::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), cfg_, 3, inputs, outputs,
               [](const HeadProblem& p, Arrays&, Arrays& out) {
                 const size_t at = fused_at(p.cfg);
                 StatsOut st;
                 if (p.cfg.stats) {
                   st = {out[2].data<float>(), out[3].data<bool>(), out[4].data<float>(),
                         p.cfg.fused ? out[at + 1].data<float>() : nullptr};
                 }
                 cpu::forward(p, out[0].data<float>(), out[1].data<float>(),
                              p.cfg.fused ? out[at].data<float>() : nullptr, st);
               });
}

void FlashCCEFusedDh::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), cfg_, cfg_.stats ? 9 : 7, inputs, outputs,
               [](HeadProblem p, Arrays& in, Arrays& out) {
                 p.h_dtype = out[0].dtype();
                 const bool st = p.cfg.stats;
                 cpu::fused_dh(p, in[0].data<float>(), in[3].data<float>(),
                               in[4].data<float>(), in[5].data<float>(),
                               in[6].data<float>(), out[0].data<void>(),
                               st ? in[7].data<float>() : nullptr,
                               st ? in[8].data<float>() : nullptr);
               });
}

void FlashCCEBackward::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  dispatch_cpu(stream(), cfg_, cfg_.stats ? 8 : 6, inputs, outputs,
               [](const HeadProblem& p, Arrays& in, Arrays& out) {
                 EntropyGrad ent;
                 if (p.cfg.stats) {
                   ent = {in[6].data<float>(), in[7].data<float>()};
                 }
                 cpu::backward(p, in[3].data<float>(), in[4].data<float>(),
                               in[5].data<float>(), out[0].data<void>(),
                               out.size() > 1 ? out[1].data<void>() : nullptr, ent);
               });
}

// The entropy statistics have CPU, CUDA and Metal kernels (every head and
// dtype those run).
bool supports_stats(const mx::Device& d) {
#if defined(FLASH_CCE_CUDA) || defined(FLASH_CCE_METAL)
  return true;
#else
  return d == mx::Device::cpu;
#endif
}

// Whether the forward on this stream can also emit the gradient state (third
// output).
bool supports_fused(const mx::Stream& s, mx::Dtype h_dtype, bool stats) {
  if (s.device == mx::Device::cpu) {
    return true;
  }
#if defined(FLASH_CCE_CUDA)
  // The CUDA kernels' entropy statistics come with the plain forward only:
  // the backward recomputes the logits (no gsum_ent state).
  (void)h_dtype;
  return !stats;
#elif defined(FLASH_CCE_METAL)
  return metal::supports_fused(h_dtype, stats);
#else
  (void)h_dtype;
  (void)stats;
  return false;
#endif
}

#if defined(FLASH_CCE_CUDA) || defined(FLASH_CCE_METAL)
#if defined(FLASH_CCE_CUDA)
namespace gpu = cuda;
#else
namespace gpu = metal;
#endif
bool has_gpu_kernels() {
  return true;
}
void FlashCCEForward::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  gpu::forward(stream(), make_problem(inputs, cfg_), inputs, outputs);
}
void FlashCCEBackward::eval_gpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  gpu::backward(stream(), make_problem(inputs, cfg_), inputs, outputs);
}
void FlashCCEFusedDh::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto p = make_problem(inputs, cfg_);
  p.h_dtype = outputs[0].dtype();
  gpu::fused_dh(stream(), p, inputs, outputs);
}
#else
bool has_gpu_kernels() {
  return false;
}
void FlashCCEForward::eval_gpu(const std::vector<mx::array>&,
                               std::vector<mx::array>&) {
  throw std::runtime_error(
      "[flash_cce] this build has no GPU kernel; use backend='fallback'");
}
void FlashCCEBackward::eval_gpu(const std::vector<mx::array>&,
                                std::vector<mx::array>&) {
  throw std::runtime_error(
      "[flash_cce] this build has no GPU kernel; use backend='fallback'");
}
void FlashCCEFusedDh::eval_gpu(const std::vector<mx::array>&,
                               std::vector<mx::array>&) {
  throw std::runtime_error(
      "[flash_cce] this build has no GPU kernel; use backend='fallback'");
}
#endif

// The CUDA fatbin's image and launch sizes; other builds have neither.
#if defined(FLASH_CCE_CUDA)
std::string gpu_kernel_image() {
  mx::Device d = mx::default_device();
  return cuda::kernel_image(d == mx::Device::gpu ? d.index : 0);
}
std::vector<std::pair<std::string, int64_t>> gpu_launch_plan(const HeadTuning& tuning) {
  check_tuning(tuning);
  mx::Device d = mx::default_device();
  return cuda::launch_plan_items(d == mx::Device::gpu ? d.index : 0, tuning);
}
#else
std::string gpu_kernel_image() {
  throw std::runtime_error("[flash_cce] this build has no CUDA kernels");
}
std::vector<std::pair<std::string, int64_t>> gpu_launch_plan(const HeadTuning&) {
  throw std::runtime_error("[flash_cce] this build has no CUDA kernels");
}
#endif

void check_plan_limits(const PlanLimits& limits) {
  if (limits.max_splits < 0 || limits.round_blocks < 0) {
    throw std::invalid_argument("[flash_cce] max_splits and round_blocks must be >= 0, got " +
                                std::to_string(limits.max_splits) + " and " +
                                std::to_string(limits.round_blocks));
  }
}

#ifdef FLASH_CCE_METAL
bool has_metal_kernels() {
  return true;
}
MetalLibraryStatus metal_library_status() {
  return metal::library_status();
}
void metal_plan_limits(const PlanLimits& limits, const mx::Stream& s) {
  metal::set_plan_limits(s, limits);
}
std::vector<MetalCompile> metal_compiled_libraries() {
  return metal::compiled_libraries();
}
#else
bool has_metal_kernels() {
  return false;
}
MetalLibraryStatus metal_library_status() {
  return {"", "", "this build has no Metal kernels"};
}
std::vector<MetalCompile> metal_compiled_libraries() {
  return {};
}
void metal_plan_limits(const PlanLimits& limits, const mx::Stream&) {
  check_plan_limits(limits);
}
#endif

} // namespace flash_cce
