// CPU flash-CCE head. Threads take vocabulary blocks of VB rows from a shared
// counter; a block's weight rows are converted (dequantized) to fp32 once, its
// logits tile [M, VB] lives in per-thread scratch, and only per-row running
// statistics leave the thread. Scratch comes from MLX's allocator so that it
// shows in mx.get_peak_memory().
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "../head_kernels.h"
#include "gemm.h"
#include "mlx/allocator.h"
#include "vmath.h"

namespace flash_cce::cpu {

namespace {

constexpr int64_t VB = 128; // vocabulary rows per block

int thread_count(int64_t blocks) {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* env = std::getenv("FLASH_CCE_NUM_THREADS")) {
    n = std::atoi(env);
  }
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, std::max(n, 1)));
}

template <class F>
void run_threads(int n, F&& fn) {
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) {
    pool.emplace_back(fn, t);
  }
  fn(0);
  for (auto& th : pool) {
    th.join();
  }
}

// One MLX allocation carved into float arrays.
class Scratch {
 public:
  explicit Scratch(int64_t floats)
      : data_(mx::allocator::malloc(std::max<int64_t>(floats, 1) * sizeof(float))) {}
  float* base() {
    return static_cast<float*>(data_.buffer().raw_ptr());
  }

 private:
  mx::allocator::Data data_;
};

Elem elem_of(mx::Dtype t) {
  return t == mx::bfloat16 ? Elem::bf16 : t == mx::float16 ? Elem::f16 : Elem::f32;
}

float load_float(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::bf16: {
      uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case Elem::f16:
      return static_cast<float>(static_cast<const _Float16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void store_float(void* p, Elem e, int64_t i, float v) {
  switch (e) {
    case Elem::bf16: {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits += 0x7fff + ((bits >> 16) & 1); // round to nearest even
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
      break;
    }
    case Elem::f16:
      static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// Rows [v0, v0 + n) of the head as fp32 [n, H]; affine dequant for packed weights.
void load_rows(const HeadProblem& p, int64_t v0, int64_t n, float* out) {
  const int64_t H = p.H;
  if (!p.cfg.quantized) {
    const Elem e = elem_of(p.w_dtype);
    if (e == Elem::f32) {
      std::memcpy(out, static_cast<const float*>(p.w) + v0 * H, n * H * sizeof(float));
      return;
    }
    for (int64_t i = 0; i < n * H; ++i) {
      out[i] = load_float(p.w, e, v0 * H + i);
    }
    return;
  }
  const int bits = p.cfg.bits;
  const int64_t gs = p.cfg.group_size, groups = H / gs;
  const int64_t row_bytes = H * bits / 8;
  const Elem se = elem_of(p.sb_dtype);
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t v = v0 + r;
    const auto* q = static_cast<const uint8_t*>(p.w) + v * row_bytes;
    float* o = out + r * H;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = load_float(p.scales, se, v * groups + g);
      const float bias = load_float(p.biases, se, v * groups + g);
      for (int64_t i = g * gs; i < (g + 1) * gs; ++i) {
        uint32_t val;
        if (bits == 8) {
          val = q[i];
        } else if (bits == 4) {
          val = (q[i >> 1] >> ((i & 1) * 4)) & 0xf;
        } else {
          // LSB-first bit stream; an element spans at most two bytes.
          const int64_t bit = i * bits, byte = bit >> 3;
          uint32_t two = q[byte];
          if (byte + 1 < row_bytes) {
            two |= uint32_t(q[byte + 1]) << 8;
          }
          val = (two >> (bit & 7)) & mask;
        }
        o[i] = scale * static_cast<float>(val) + bias;
      }
    }
  }
}

MatView h_view(const HeadProblem& p) {
  return {p.h, p.H, false, elem_of(p.h_dtype)};
}

// s <- cap * tanh(s / cap); dcap <- 1 - tanh^2 when asked.
void apply_softcap(float* s, float* dcap, int64_t n, float cap) {
  softcap_inplace(s, dcap, n, cap);
}

bool target_in(int32_t y, int64_t v0, int64_t n) {
  return y >= v0 && y < v0 + n;
}

} // namespace

void forward(const HeadProblem& p, float* logp, float* lse) {
  const int64_t M = p.M, H = p.H, V = p.V;
  const int64_t blocks = (V + VB - 1) / VB;
  const int T = thread_count(blocks);
  const int64_t gemm_floats = sgemm_scratch_floats(VB);
  const int64_t per_thread = VB * H + M * VB + 2 * M + gemm_floats;
  Scratch scratch(T * per_thread + M);
  float* target_logit = scratch.base() + T * per_thread;
  std::fill(target_logit, target_logit + M, std::numeric_limits<float>::quiet_NaN());
  std::atomic<int64_t> next{0};
  const float cap = p.cfg.softcap;

  run_threads(T, [&](int t) {
    float* base = scratch.base() + t * per_thread;
    float* wrows = base;
    float* s = wrows + VB * H;
    float* run_max = s + M * VB;
    float* run_sum = run_max + M;
    GemmScratch gs = sgemm_scratch(run_sum + M);
    std::fill(run_max, run_max + M, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + M, 0.0f);
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      const int64_t v0 = b * VB, n = std::min(VB, V - v0);
      load_rows(p, v0, n, wrows);
      sgemm(M, n, H, h_view(p), {wrows, H, true}, s, VB, false, gs);
      for (int64_t m = 0; m < M; ++m) {
        float* row = s + m * VB;
        if (cap > 0) {
          apply_softcap(row, nullptr, n, cap);
        }
        const float bmax = *std::max_element(row, row + n);
        if (bmax > run_max[m]) {
          run_sum[m] *= std::exp(run_max[m] - bmax);
          run_max[m] = bmax;
        }
        run_sum[m] += sum_exp_shifted(row, n, run_max[m]);
        const int32_t y = p.targets[m];
        if (target_in(y, v0, n)) {
          target_logit[m] = row[y - v0];
        }
      }
    }
  });

  for (int64_t m = 0; m < M; ++m) {
    float gmax = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < T; ++t) {
      gmax = std::max(gmax, scratch.base()[t * per_thread + VB * H + M * VB + m]);
    }
    double total = 0.0;
    for (int t = 0; t < T; ++t) {
      const float* st = scratch.base() + t * per_thread + VB * H + M * VB;
      if (st[m] > -std::numeric_limits<float>::infinity()) {
        total += static_cast<double>(st[M + m]) * std::exp(double(st[m]) - gmax);
      }
    }
    lse[m] = gmax + static_cast<float>(std::log(total));
    const int32_t y = p.targets[m];
    logp[m] = y == p.cfg.ignore_index ? 0.0f : target_logit[m] - lse[m];
  }
}

void backward(const HeadProblem& p, const float* lse, const float* g,
              const float* g_lse, void* dh, void* dw) {
  const int64_t M = p.M, H = p.H, V = p.V;
  const int64_t blocks = (V + VB - 1) / VB;
  const int T = thread_count(blocks);
  const int64_t gemm_floats = sgemm_scratch_floats(std::max(VB, H));
  const int64_t per_thread = VB * H + M * VB + M * H + 2 * M + gemm_floats;
  Scratch scratch(T * per_thread);
  std::atomic<int64_t> next{0};
  const float cap = p.cfg.softcap;
  const Elem w_elem = elem_of(p.w_dtype);

  run_threads(T, [&](int t) {
    float* wrows = scratch.base() + t * per_thread;
    float* s = wrows + VB * H;
    float* dh_part = s + M * VB;
    float* gm = dh_part + M * H;
    float* coef = gm + M;
    GemmScratch gs = sgemm_scratch(coef + M);
    std::fill(dh_part, dh_part + M * H, 0.0f);
    // Ignored and out-of-range rows take no gradient through logp.
    for (int64_t m = 0; m < M; ++m) {
      const int32_t y = p.targets[m];
      const bool ok = y != p.cfg.ignore_index && y >= 0 && y < V;
      gm[m] = ok ? g[m] : 0.0f;
      coef[m] = g_lse[m] - gm[m];
    }
    std::vector<float> dcap(cap > 0 ? VB : 0);
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      const int64_t v0 = b * VB, n = std::min(VB, V - v0);
      load_rows(p, v0, n, wrows);
      sgemm(M, n, H, h_view(p), {wrows, H, true}, s, VB, false, gs);
      // dS = (g * onehot + (g_lse - g) * softmax) * dcap, in place.
      for (int64_t m = 0; m < M; ++m) {
        float* row = s + m * VB;
        if (cap > 0) {
          apply_softcap(row, dcap.data(), n, cap);
        }
        scaled_exp_shifted(row, n, lse[m], coef[m]);
        const int32_t y = p.targets[m];
        if (target_in(y, v0, n)) {
          row[y - v0] += gm[m];
        }
        if (cap > 0) {
          for (int64_t j = 0; j < n; ++j) {
            row[j] *= dcap[j];
          }
        }
      }
      sgemm(M, H, n, {s, VB}, {wrows, H}, dh_part, H, true, gs);
      if (dw) {
        // dW rows = dS^T @ h, staged in wrows (done with the weight now).
        sgemm(n, H, M, {s, VB, true}, h_view(p), wrows, H, false, gs);
        for (int64_t i = 0; i < n * H; ++i) {
          store_float(dw, w_elem, v0 * H + i, wrows[i]);
        }
      }
    }
  });

  const Elem h_elem = elem_of(p.h_dtype);
  for (int64_t i = 0; i < M * H; ++i) {
    float acc = 0.0f;
    for (int t = 0; t < T; ++t) {
      acc += scratch.base()[t * per_thread + VB * H + M * VB + i];
    }
    store_float(dh, h_elem, i, acc);
  }
}

} // namespace flash_cce::cpu
