// Python bindings: flash_cce._ext. Built with NB_DOMAIN mlx so that mlx.core's
// array, Stream and Device types are shared with this module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/gemm.h"
#include "flash_cce.h"
#include "metal/cost.h"
#include "rows.h"

namespace nb = nanobind;
using namespace nb::literals;
using flash_cce::HeadTuning;
using flash_cce::mx::array;

namespace {

// A `tuning` argument: None or a dict of HeadTuning keys; a None value keeps
// the default. Raises ValueError naming a bad key or value.
HeadTuning tuning_from(const nb::handle& obj) {
  HeadTuning t;
  if (obj.is_none()) {
    return t;
  }
  if (!nb::isinstance<nb::dict>(obj)) {
    throw std::invalid_argument("[flash_cce] tuning must be a dict or None, got " +
                                std::string(nb::str(nb::type_name(obj.type())).c_str()));
  }
  for (auto [k, v] : nb::borrow<nb::dict>(obj)) {
    if (!nb::isinstance<nb::str>(k)) {
      throw std::invalid_argument("[flash_cce] tuning keys must be strings");
    }
    const std::string key = nb::cast<std::string>(k);
    if (v.is_none()) {
      flash_cce::set_tuning(t, key, 0, false);
      continue;
    }
    const bool is_bool = nb::isinstance<nb::bool_>(v);
    if (!is_bool && !nb::isinstance<nb::int_>(v)) {
      throw std::invalid_argument("[flash_cce] tuning['" + key + "'] must be a bool or an int, got " +
                                  std::string(nb::str(nb::type_name(v.type())).c_str()));
    }
    flash_cce::set_tuning(t, key, is_bool ? int64_t(nb::cast<bool>(v)) : nb::cast<int64_t>(v),
                          is_bool);
  }
  return t;
}

nb::dict tuning_dict(const HeadTuning& t) {
  nb::dict d;
  for (const auto& item : flash_cce::tuning_items(t)) {
    if (item.flag) {
      d[item.key.c_str()] = item.value != 0;
    } else {
      d[item.key.c_str()] = item.value;
    }
  }
  return d;
}

nb::dict plan_dict(const std::vector<std::pair<std::string, int64_t>>& items) {
  nb::dict d;
  for (const auto& [k, v] : items) {
    d[k.c_str()] = v;
  }
  return d;
}

namespace fm = flash_cce::metal;

fm::DType metal_dtype(const std::string& name, const char* what) {
  if (name == "float32") return fm::DType::f32;
  if (name == "float16") return fm::DType::f16;
  if (name == "bfloat16") return fm::DType::bf16;
  throw std::invalid_argument(std::string("[flash_cce] ") + what +
                              " must be 'float32', 'float16' or 'bfloat16', got '" + name + "'");
}

const fm::AppleGpu& metal_gpu(const std::string& name) {
  if (const fm::AppleGpu* g = fm::find_apple_gpu(name)) {
    return *g;
  }
  std::string known;
  for (const auto& g : fm::apple_gpus()) known += std::string(known.empty() ? "" : ", ") + g.name;
  throw std::invalid_argument("[flash_cce] gpu must be one of " + known + ", got '" + name + "'");
}

nb::dict cost_dict(const fm::LaunchCost& c, const fm::AppleGpu& gpu) {
  nb::dict d;
  d["kernel"] = c.kernel;
  d["flops"] = c.flops;
  d["bytes_read"] = c.bytes_read;
  d["bytes_written"] = c.bytes_written;
  d["threadgroup_bytes"] = c.threadgroup_bytes;
  d["threadgroups"] = c.threadgroups;
  d["threads"] = c.threads;
  d["seconds"] = fm::estimate_seconds(c, gpu);
  return d;
}

// The cost model (csrc/metal/cost.h) of one primitive's Metal launch plan.
nb::dict metal_cost(const std::string& pass, int64_t M, int64_t H, int64_t V,
                    const std::string& h, const std::string& w, const std::string& sb,
                    bool quantized, int bits, int group_size, bool fused, bool compute_dw,
                    int acc_registers, bool stats, const std::string& gpu_name) {
  fm::Problem p;
  if (pass == "forward") p.pass = fm::Pass::forward;
  else if (pass == "backward") p.pass = fm::Pass::backward;
  else if (pass == "fused_dh") p.pass = fm::Pass::fused_dh;
  else
    throw std::invalid_argument("[flash_cce] pass must be 'forward', 'backward' or 'fused_dh', got '" +
                                pass + "'");
  p.M = M;
  p.H = H;
  p.V = V;
  p.h = p.out = metal_dtype(h, "h");
  p.w = metal_dtype(w, "w");
  p.sb = metal_dtype(sb, "sb");
  p.quantized = quantized;
  p.bits = bits;
  p.group_size = group_size;
  p.fused = fused;
  p.compute_dw = compute_dw;
  p.acc_registers = acc_registers;
  p.stats = stats;
  const fm::AppleGpu& gpu = metal_gpu(gpu_name);
  const auto costs = fm::plan_cost(p, fm::make_plan(p));
  const fm::PassCost t = fm::pass_cost(costs, gpu);
  nb::list launches;
  for (const auto& c : costs) launches.append(cost_dict(c, gpu));
  nb::dict d;
  d["gpu"] = gpu.name;
  d["launches"] = launches;
  d["flops"] = t.flops;
  d["bytes_read"] = t.bytes_read;
  d["bytes_written"] = t.bytes_written;
  d["seconds"] = t.seconds;
  d["longest_seconds"] = t.longest_seconds;
  return d;
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flash-CCE head primitives for MLX";

  m.def(
      "forward",
      [](const array& h, const array& w, const array& targets,
         const std::optional<array>& scales, const std::optional<array>& biases,
         int group_size, std::optional<int> bits, std::optional<float> softcap,
         int ignore_index, bool fused_backward, nb::handle tuning,
         flash_cce::mx::StreamOrDevice s, bool stats) {
        return flash_cce::flash_cce_forward(h, w, targets, scales, biases, group_size, bits,
                                            softcap, ignore_index, fused_backward,
                                            tuning_from(tuning), s, stats);
      },
      "h"_a, "w"_a, "targets"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
      nb::kw_only(), "group_size"_a = 64, "bits"_a = nb::none(), "softcap"_a = nb::none(),
      "ignore_index"_a = -100, "fused_backward"_a = true, "tuning"_a = nb::none(),
      "stream"_a = nb::none(), "stats"_a = false,
      "Returns [logp, lse] (float32, shape h.shape[:-1]); with stats also entropy, "
      "is_top1 (bool) and mean_logit.");

  m.def(
      "backward",
      [](const array& h, const array& w, const array& targets, const array& lse,
         const array& g, const std::optional<array>& g_lse,
         const std::optional<array>& scales, const std::optional<array>& biases,
         int group_size, std::optional<int> bits, std::optional<float> softcap,
         int ignore_index, bool compute_dw, nb::handle tuning,
         flash_cce::mx::StreamOrDevice s, const std::optional<array>& entropy,
         const std::optional<array>& g_entropy) {
        return flash_cce::flash_cce_backward(h, w, targets, lse, g, g_lse, scales, biases,
                                             group_size, bits, softcap, ignore_index,
                                             compute_dw, tuning_from(tuning), s, entropy,
                                             g_entropy);
      },
      "h"_a, "w"_a, "targets"_a, "lse"_a, "g"_a, "g_lse"_a = nb::none(),
      "scales"_a = nb::none(), "biases"_a = nb::none(), nb::kw_only(), "group_size"_a = 64,
      "bits"_a = nb::none(), "softcap"_a = nb::none(), "ignore_index"_a = -100,
      "compute_dw"_a = false, "tuning"_a = nb::none(), "stream"_a = nb::none(),
      "entropy"_a = nb::none(), "g_entropy"_a = nb::none(),
      "Returns [dh] or [dh, dw]; entropy and g_entropy add the entropy's gradient.");

  m.def(
      "check_tuning",
      [](nb::handle tuning) { return tuning_dict(tuning_from(tuning)); },
      "tuning"_a = nb::none(),
      "Validates a tuning dict; returns every key with its value (0: chosen from the device).");
  m.def(
      "gpu_launch_plan",
      [](nb::handle tuning) { return plan_dict(flash_cce::gpu_launch_plan(tuning_from(tuning))); },
      "tuning"_a = nb::none(),
      "The launch sizes a tuning resolves to on the default GPU, with its SM count and L2 size.");

  m.def(
      "check_args",
      [](const array& h, const array& w, const array& targets,
         const std::optional<array>& scales, const std::optional<array>& biases,
         int group_size, std::optional<int> bits, std::optional<float> softcap) {
        auto cfg = flash_cce::check_head_args(h, w, targets, scales, biases,
                                              group_size, bits, softcap, -100);
        return cfg.quantized ? std::optional<int>(cfg.bits) : std::nullopt;
      },
      "h"_a, "w"_a, "targets"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
      "group_size"_a = 64, "bits"_a = nb::none(), "softcap"_a = nb::none(),
      "Validates head arguments; returns the bit width of a quantized w.");

  m.def(
      "supports_stats",
      [](const flash_cce::mx::Device& d) { return flash_cce::supports_stats(d); }, "device"_a,
      "Whether the native kernels of the device compute the entropy statistics.");
  m.def(
      "take_rows",
      [](const array& table, const array& ids, flash_cce::mx::StreamOrDevice s) {
        return flash_cce::take_rows(table, ids, s);
      },
      "table"_a, "ids"_a, nb::kw_only(), "stream"_a = nb::none(),
      "table[ids] for a 2-D table (rows of an embedding), a zero row for an id outside [0, rows).");
  m.def("has_gpu_take_rows", &flash_cce::has_gpu_take_rows);
  m.def("has_gpu_kernels", &flash_cce::has_gpu_kernels);
  m.def("gpu_kernel_image", &flash_cce::gpu_kernel_image,
        "The CUDA kernels' fatbin image on the default GPU and the kernels it routes to.");
  m.def("has_metal_kernels", &flash_cce::has_metal_kernels);
  m.def(
      "metal_library",
      [] {
        auto st = flash_cce::metal_library_status();
        return std::make_tuple(st.source, st.path, st.error);
      },
      "Loads the Metal kernels' library once; returns (source, path, error).");
  m.def(
      "metal_compiled",
      [] {
        std::vector<std::tuple<std::vector<std::string>, size_t, double>> out;
        for (const auto& c : flash_cce::metal_compiled_libraries()) {
          out.emplace_back(c.kernels, c.source_bytes, c.seconds);
        }
        return out;
      },
      "The Metal libraries compiled from source so far: (kernels, source bytes, seconds).");
  m.def(
      "metal_plan_limits",
      [](int max_splits, int round_blocks, flash_cce::mx::StreamOrDevice s) {
        flash_cce::metal_plan_limits({max_splits, round_blocks}, flash_cce::mx::to_stream(s));
      },
      "max_splits"_a = 0, "round_blocks"_a = 0, "stream"_a = nb::none(),
      "Caps the Metal kernels' vocabulary splits and blocks per launch round on `stream` "
      "(0: the plan's choice).");
  m.def("metal_cost", &metal_cost, "pass_"_a, "M"_a, "H"_a, "V"_a, nb::kw_only(),
        "h"_a = "bfloat16", "w"_a = "bfloat16", "sb"_a = "bfloat16", "quantized"_a = false,
        "bits"_a = 4, "group_size"_a = 64, "fused"_a = false, "compute_dw"_a = false,
        "acc_registers"_a = 0, "stats"_a = false, "gpu"_a = "Apple M1 Max",
        "The cost model of the Metal launch plan of one primitive (csrc/metal/cost.h): per "
        "launch and in all, flops, device bytes, threadgroup memory, threads and the estimated "
        "seconds on a named Apple GPU. Runs nothing.");
  m.def(
      "metal_qmm_cost",
      [](int64_t M, int64_t N, int64_t K, int x_bytes, int bits, int group_size, int sb_bytes,
         const std::string& gpu) {
        return cost_dict(fm::mlx_qmm_cost(M, N, K, x_bytes, bits, group_size, sb_bytes),
                         metal_gpu(gpu));
      },
      "M"_a, "N"_a, "K"_a, nb::kw_only(), "x_bytes"_a = 2, "bits"_a = 4, "group_size"_a = 64,
      "sb_bytes"_a = 2, "gpu"_a = "Apple M1 Max",
      "The same model of MLX's steel quantized matmul x @ w^T ([M, K] x [N, K]).");
  m.def(
      "metal_gpus",
      [] {
        nb::list out;
        for (const auto& g : fm::apple_gpus()) {
          nb::dict d;
          d["name"] = g.name;
          d["cores"] = g.cores;
          d["fp32_flops"] = g.fp32_flops;
          d["fp16_flops"] = g.fp16_flops;
          d["bandwidth"] = g.bandwidth;
          out.append(d);
        }
        return out;
      },
      "The Apple GPUs the cost model knows, with their published peak rates.");
  m.def("cpu_gemm_kernel", &flash_cce::cpu::sgemm_kernel_name);
  m.def("cpu_gemm_kernels", &flash_cce::cpu::sgemm_kernels,
        "The CPU GEMM micro-kernels this build has and the processor runs, best first.");
  m.def("cpu_gemm_select", &flash_cce::cpu::sgemm_select, "name"_a,
        "Switches the CPU GEMM micro-kernel (benchmarks, tests); false for an unknown name.");
}
