// Python bindings: flash_cce._ext. Built with NB_DOMAIN mlx so that mlx.core's
// array, Stream and Device types are shared with this module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/gemm.h"
#include "flash_cce.h"

namespace nb = nanobind;
using namespace nb::literals;
using flash_cce::mx::array;

NB_MODULE(_ext, m) {
  m.doc() = "flash-CCE head primitives for MLX";

  m.def("forward", &flash_cce::flash_cce_forward, "h"_a, "w"_a, "targets"_a,
        "scales"_a = nb::none(), "biases"_a = nb::none(), nb::kw_only(),
        "group_size"_a = 64, "bits"_a = nb::none(), "softcap"_a = nb::none(),
        "ignore_index"_a = -100, "fused_backward"_a = true, "stream"_a = nb::none(),
        "Returns [logp, lse] (float32, shape h.shape[:-1]).");

  m.def("backward", &flash_cce::flash_cce_backward, "h"_a, "w"_a, "targets"_a,
        "lse"_a, "g"_a, "g_lse"_a = nb::none(), "scales"_a = nb::none(),
        "biases"_a = nb::none(), nb::kw_only(), "group_size"_a = 64,
        "bits"_a = nb::none(), "softcap"_a = nb::none(), "ignore_index"_a = -100,
        "compute_dw"_a = false, "stream"_a = nb::none(),
        "Returns [dh] or [dh, dw].");

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

  m.def("has_gpu_kernels", &flash_cce::has_gpu_kernels);
  m.def("has_metal_kernels", &flash_cce::has_metal_kernels);
  m.def(
      "metal_library",
      [] {
        auto st = flash_cce::metal_library_status();
        return std::make_tuple(st.source, st.path, st.error);
      },
      "Loads the Metal kernels' library once; returns (source, path, error).");
  m.def("cpu_gemm_kernel", &flash_cce::cpu::sgemm_kernel_name);
}
