// flash-CCE head: fused linear log-probabilities for MLX.
//
//   s = h @ W^T (fp32 accumulation), optionally s = cap * tanh(s / cap)
//   lse = logsumexp(s), logp = s[y] - lse
//
// The [M, V] logits and a dequantized [V, H] weight never reach device memory.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "tuning.h"

namespace flash_cce {

namespace mx = mlx::core;

// What the kernels need to know besides the arrays.
struct HeadConfig {
  bool quantized = false;
  int group_size = 64;
  int bits = 4;
  float softcap = 0.0f; // 0 means off
  int ignore_index = -100;
  // The forward also emits sum_v softmax_v * dcap_v * W_v per row, so that the
  // gradient for h needs no second pass over the vocabulary (2 GEMMs, not 3).
  bool fused = false;
  // The forward also returns the entropy statistics (entropy, is_top1,
  // mean logit) and the backward takes the entropy's cotangent.
  bool stats = false;
  // Kernel choices and launch sizes (tuning.h).
  HeadTuning tuning;

  bool operator==(const HeadConfig&) const = default;
};

// Operations ------------------------------------------------------------------

// Validates the arguments and raises std::invalid_argument naming the bad one.
// Returns the config the primitives run with.
HeadConfig check_head_args(
    const mx::array& h,
    const mx::array& w,
    const mx::array& targets,
    const std::optional<mx::array>& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    std::optional<int> bits,
    std::optional<float> softcap,
    int ignore_index);

// h[..., H], targets[...] -> (logp[...], lse[...]), both float32.
// fused_backward: where the backend supports it, the forward also keeps one
// [M, H] float32 array from which the VJP forms dh without revisiting W.
// tuning: kernel choices and launch sizes (tuning.h), kept by the primitives
// and passed on to the backward.
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
    bool fused_backward = true,
    const HeadTuning& tuning = {},
    mx::StreamOrDevice s = {},
    bool stats = false);

// Gradient of sum(g * logp + g_lse * lse) -> {dh} or {dh, dw}. With `entropy`
// (the forward's) and `g_entropy`, also of sum(g_entropy * entropy).
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
    const HeadTuning& tuning = {},
    mx::StreamOrDevice s = {},
    const std::optional<mx::array>& entropy = std::nullopt,
    const std::optional<mx::array>& g_entropy = std::nullopt);

// True when the native kernels of device `d` compute the entropy statistics.
bool supports_stats(const mx::Device& d);

// True when eval_gpu has a native kernel in this build (CUDA or Metal).
bool has_gpu_kernels();
// The CUDA kernels' image on the default GPU and the kernels it routes to
// (loads them); an error in a build without GPU kernels.
std::string gpu_kernel_image();
// The launch sizes `tuning` resolves to on the default GPU, with the device
// attributes they come from, as (name, value) pairs; an error in a build
// without GPU kernels.
std::vector<std::pair<std::string, int64_t>> gpu_launch_plan(const HeadTuning& tuning);

// True when this build has the Metal kernels (an Apple build).
bool has_metal_kernels();

// Where the Metal kernels' library came from, after loading it once:
// source is "metallib" (built with the module), "source" (compiled at run
// time from the embedded source) or empty when neither worked; error holds the
// reasons (also a metallib's that was passed over for the source).
struct MetalLibraryStatus {
  std::string source, path, error;
};
MetalLibraryStatus metal_library_status();

// One Metal library compiled from the embedded source: the kernels it holds
// (one launch plan's), its source size and the seconds get_library took.
struct MetalCompile {
  std::vector<std::string> kernels;
  size_t source_bytes;
  double seconds;
};
// The libraries compiled so far in this process (empty without Metal kernels
// or with a metallib).
std::vector<MetalCompile> metal_compiled_libraries();

// Caps the Metal kernels' vocabulary splits and blocks per launch round for
// launches encoded on stream `s` (0: the plan's choice), so that the
// self-check runs long splits and resumed rounds at small sizes. No effect in
// a build without Metal kernels (no splits there); negative values raise.
struct PlanLimits {
  int max_splits = 0;
  int round_blocks = 0;
};
void check_plan_limits(const PlanLimits& limits);
void metal_plan_limits(const PlanLimits& limits, const mx::Stream& s);

// True when the backend of `s` implements the fused forward outputs for h_dtype
// (with the entropy statistics when `stats`).
bool supports_fused(const mx::Stream& s, mx::Dtype h_dtype, bool stats = false);

// Primitives ------------------------------------------------------------------

// Inputs: h[M,H], w, targets[M] int32 (+ scales, biases).
// Outputs: logp[M], lse[M] (+ entropy[M], is_top1[M] bool, mean_logit[M] when
// cfg.stats) (+ gsum[M,H] float32 when cfg.fused, + gsum_ent[M,H] with both).
class FlashCCEForward : public mx::Primitive {
 public:
  FlashCCEForward(mx::Stream stream, HeadConfig cfg)
      : mx::Primitive(stream), cfg_(cfg) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>& outputs) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "FlashCCEForward";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  HeadConfig cfg_;
};

// Inputs: h, w, targets, lse, g, g_lse (+ entropy, g_ent when cfg.stats)
// (+ scales, biases). Outputs: dh (+ dw).
class FlashCCEBackward : public mx::Primitive {
 public:
  FlashCCEBackward(mx::Stream stream, HeadConfig cfg, bool compute_dw)
      : mx::Primitive(stream), cfg_(cfg), compute_dw_(compute_dw) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

  const char* name() const override {
    return "FlashCCEBackward";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  HeadConfig cfg_;
  bool compute_dw_;
};

// The gradient for h from the fused forward's state: dh = g dcap_y W_y +
// (g_lse - g) gsum in one pass over [M, H]. Inputs: gsum[M,H] float32, w,
// targets, logp, lse, g, g_lse (+ gsum_ent[M,H], g_ent when cfg.stats)
// (+ scales, biases). Output: dh[M,H] in out_dtype.
class FlashCCEFusedDh : public mx::Primitive {
 public:
  FlashCCEFusedDh(mx::Stream stream, HeadConfig cfg, mx::Dtype out_dtype)
      : mx::Primitive(stream), cfg_(cfg), out_dtype_(out_dtype) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  const char* name() const override {
    return "FlashCCEFusedDh";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  HeadConfig cfg_;
  mx::Dtype out_dtype_;
};

} // namespace flash_cce
