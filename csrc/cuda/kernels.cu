// CUDA kernels of the flash-CCE head, compiled by nvcc into a fatbin that the
// host code loads through the driver API; every kernel is extern "C" so it is
// found by name. The GEMM kernels' bodies: head_portable.cuh (sm_80 and later),
// head_wgmma.cuh and head_wgmma_rs.cuh (sm_90a); their entry points: entries.inc.
#include "head_portable.cuh"
#include "head_wgmma.cuh"
#include "head_wgmma_rs.cuh"

using namespace flash_cce::cuda;

// lse = logsumexp over the splits' partial (max, sum); logp = target logit - lse,
// 0 for ignored rows and NaN for targets outside [0, V). With p.entropy also
// entropy = log(sum) - r / sum (both terms relative to the row maximum, so
// nothing cancels against lse), is_top1 (the target is the first arg-max, never
// for an ignored row) and the mean logit, as the CPU kernels define them.
extern "C" __global__ void fcce_combine(CombineParams p) {
  const int64_t m = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= p.M) {
    return;
  }
  float mx = -INFINITY, l = 0.0f, r = 0.0f, tot = 0.0f;
  int32_t arg = INT32_MAX;
  for (int s = 0; s < p.splits; ++s) {
    const int64_t i = int64_t(s) * p.M + m;
    if (p.entropy) {
      merge_arg(arg, mx, p.part_arg[i], p.part_max[i]);
      merge_ent(mx, l, r, p.part_max[i], p.part_sum[i], p.part_r[i]);
      tot += p.part_tot[i];
    } else {
      merge(mx, l, p.part_max[i], p.part_sum[i]);
    }
  }
  const float lse = mx + logf(l);
  p.lse[m] = lse;
  const int32_t y = p.targets[m];
  p.logp[m] = y == p.ignore_index ? 0.0f
      : (y >= 0 && y < p.V) ? p.target_logit[m] - lse
                            : __int_as_float(0x7fc00000);
  if (p.entropy) {
    p.entropy[m] = logf(l) - r / l;
    p.top1[m] = y == arg && y != p.ignore_index;
    p.mean[m] = tot / static_cast<float>(p.V);
  }
}

// The fused forward's last step, one block per row: lse = r + log(sum of
// exp(s - r)), logp as in fcce_combine, and gsum scaled by exp(r - lse) so
// that it holds sum_v softmax_v dcap_v W_v.
extern "C" __global__ void fcce_finish(FinishParams p) {
  const int64_t m = blockIdx.x;
  const float ref = !p.ref ? p.cap : (p.flag && *p.flag) ? p.ref_exact[m] : p.ref[m];
  const float lse = ref + logf(p.run_sum[m]);
  if (threadIdx.x == 0) {
    p.lse[m] = lse;
    const int32_t y = p.targets[m];
    p.logp[m] = y == p.ignore_index ? 0.0f
        : (y >= 0 && y < p.V) ? p.target_logit[m] - lse
                              : __int_as_float(0x7fc00000);
  }
  const float scale = expf(ref - lse);
  float* row = p.gsum + m * p.H;
  for (int64_t c = threadIdx.x; c < p.H; c += blockDim.x) {
    row[c] *= scale;
  }
}

// Element (row, col) of the head in fp32: a dense read, or MLX's affine
// dequantization of the LSB-first packed codes (an element spans at most two
// bytes for bits <= 8).
__device__ __forceinline__ float weight_at(const Operand& w, int64_t row, int64_t col) {
  if (w.kind != kQuant) {
    return load_as_float(w.ptr, w.kind, row * w.ld + col);
  }
  const int64_t row_bytes = w.cols * w.bits / 8;
  const uint8_t* q = static_cast<const uint8_t*>(w.ptr) + row * row_bytes;
  const int64_t bit = col * w.bits, byte = bit >> 3;
  uint32_t two = q[byte];
  if ((bit & 7) + w.bits > 8) {
    two |= uint32_t(q[byte + 1]) << 8;
  }
  const float code = static_cast<float>((two >> (bit & 7)) & ((1u << w.bits) - 1));
  const int64_t gi = row * (w.cols / w.group_size) + col / w.group_size;
  return load_as_float(w.scales, w.sb_kind, gi) * code + load_as_float(w.biases, w.sb_kind, gi);
}

extern "C" __global__ void fcce_fused_dh(FusedDhParams p) {
  const int64_t m = blockIdx.x;
  const int32_t y = p.targets[m];
  const bool ok = y != p.ignore_index && y >= 0 && y < p.V;
  const float gm = ok ? p.g[m] : 0.0f;
  float coef_y = gm;
  if (ok && p.cap > 0.0f) {
    const float t = (p.logp[m] + p.lse[m]) / p.cap; // s_y / cap = tanh(raw / cap)
    coef_y *= 1.0f - t * t;
  }
  const float coef_rest = p.g_lse[m] - gm;
  const float* gs = p.gsum + m * p.H;
  for (int64_t c = threadIdx.x; c < p.H; c += blockDim.x) {
    const float wy = ok ? weight_at(p.w, y, c) : 0.0f;
    store_from_float(p.out, p.out_kind, m * p.H + c, coef_rest * gs[c] + coef_y * wy);
  }
}

extern "C" __global__ void fcce_row_max(RowMaxParams p) {
  if (p.guard && *p.guard == 0) {
    return;
  }
  const int64_t m = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m == 0 && p.flag) {
    *p.flag = 0;
  }
  if (m >= p.M) {
    return;
  }
  float mx = p.raise ? p.ref[m] : -INFINITY;
  for (int s = 0; s < p.splits; ++s) {
    mx = fmaxf(mx, p.part_max[int64_t(s) * p.M + m]);
  }
  p.ref[m] = mx;
}

extern "C" __global__ void fcce_zero(ZeroParams p) {
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) {
    p.data[i] = 0;
  }
}

// One warp per output row of fcce_take_rows.
template <class T>
__device__ void copy_row(const RowsParams& p, int64_t i, int lane) {
  const int64_t count = p.row_bytes / static_cast<int64_t>(sizeof(T));
  T* dst = reinterpret_cast<T*>(static_cast<char*>(p.out) + i * p.row_bytes);
  const int32_t id = p.ids[i];
  if (id < 0 || id >= p.rows) {
    for (int64_t k = lane; k < count; k += 32) {
      dst[k] = T{};
    }
    return;
  }
  const T* src = reinterpret_cast<const T*>(static_cast<const char*>(p.table) +
                                            int64_t(id) * p.row_bytes);
  for (int64_t k = lane; k < count; k += 32) {
    dst[k] = src[k];
  }
}

// Rows of a table by index (an embedding lookup), for any element type.
extern "C" __global__ void fcce_take_rows(RowsParams p) {
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (i >= p.n) {
    return;
  }
  const int lane = threadIdx.x % 32;
  switch (p.unit) {
    case 16: copy_row<uint4>(p, i, lane); break;
    case 4: copy_row<uint32_t>(p, i, lane); break;
    case 2: copy_row<uint16_t>(p, i, lane); break;
    default: copy_row<uint8_t>(p, i, lane); break;
  }
}

// The GEMM kernels, one line each (generated by gen_entries.py; the host finds
// them by name through entries.h).
#include "entries.inc"

// Which image of the fatbin the driver loaded (a SASS image, or PTX it
// compiled for this GPU): the architecture it was built for, and whether it
// holds the Hopper kernels (only an sm_90a image does; elsewhere they are empty).
#ifdef __CUDA_ARCH__
extern "C" __device__ int fcce_image_arch = __CUDA_ARCH__;
#ifdef FLASH_CCE_WGMMA
extern "C" __device__ int fcce_image_wgmma = 1;
#else
extern "C" __device__ int fcce_image_wgmma = 0;
#endif
#endif
