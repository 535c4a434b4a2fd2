// CPU flash-CCE head. Threads take vocabulary blocks of VB rows from a shared
// counter; a packed block's weight rows are dequantized to fp32 once (dense rows
// are read in place), its logits tile [M, VB] lives in per-thread scratch, and
// only per-row running statistics and [M, H] accumulators leave the thread. Scratch comes from MLX's allocator so that it
// shows in mx.get_peak_memory().
#include <algorithm>
#include <atomic>
#include <cmath>
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

// tuning.num_threads, or one thread per hardware thread.
int thread_count(const HeadTuning& t, int64_t blocks) {
  const int64_t n = t.num_threads > 0 ? t.num_threads
                                      : static_cast<int64_t>(std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, std::max<int64_t>(n, 1)));
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

// Rows [v0, v0 + n) of a packed head, affine-dequantized to fp32 [n, H].
void dequant_rows(const HeadProblem& p, int64_t v0, int64_t n, float* out) {
  const int64_t H = p.H;
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
      const float scale = load(p.scales, se, v * groups + g);
      const float bias = load(p.biases, se, v * groups + g);
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

bool target_in(int32_t y, int64_t v0, int64_t n) {
  return y >= v0 && y < v0 + n;
}

// h packed once into GEMM panels, shared by all threads.
class PackedH {
 public:
  explicit PackedH(const HeadProblem& p)
      : scratch_(sgemm_packed_a_floats(p.M, p.H)) {
    sgemm_pack_a(h_view(p), p.M, p.H, scratch_.base());
  }
  MatView view(const HeadProblem& p) {
    MatView v = h_view(p);
    v.packed = scratch_.base();
    return v;
  }

 private:
  Scratch scratch_;
};

// One thread's working set.
struct Work {
  int t;          // the thread's index
  MatView wblock; // [n, H] the current block's weight rows
  float* wrows;   // [VB, H] fp32 rows: dequantized weights, or staged dW rows
  float* s;       // [tiles * M, VB] the block's logits, then its dS or probabilities
  float* acc;   // [tiles * M, H] this thread's share of a [M, H] result (or two), or null
  float* r0;    // [M] per-row state (running max, or masked g)
  float* r1;    // [M] (running sum, or g_lse - g)
  float* dcap;  // [VB] softcap derivative of one row
  GemmScratch gemm;
};

// Per-thread working sets carved from one MLX allocation. `acc0`, when given,
// is thread 0's [M, H] accumulator (an output buffer), saving one copy. With
// `tiles` = 2 the logits tile and the accumulator hold two [M, ...] halves (the
// entropy's weighted rows below the softmax's).
class Workspace {
 public:
  Workspace(int threads, const HeadProblem& p, bool with_acc, bool with_rows,
            int64_t max_n, float* acc0 = nullptr, int tiles = 1)
      : M_(p.M), H_(p.H), tiles_(tiles), rows_(with_rows ? VB * p.H : 0),
        acc_(with_acc ? tiles * p.M * p.H : 0), acc0_(acc0),
        per_thread_(rows_ + tiles * p.M * VB + 2 * p.M + VB +
                    sgemm_scratch_floats(max_n)),
        threads_(threads),
        scratch_(threads * per_thread_ + (threads - (acc0 ? 1 : 0)) * acc_) {}

  std::vector<Work> all() {
    std::vector<Work> works;
    for (int t = 0; t < threads_; ++t) {
      works.push_back(at(t));
    }
    return works;
  }

  Work at(int t) {
    Work w;
    w.t = t;
    w.wrows = scratch_.base() + t * per_thread_;
    w.s = w.wrows + rows_;
    w.r0 = w.s + tiles_ * M_ * VB;
    w.r1 = w.r0 + M_;
    w.dcap = w.r1 + M_;
    w.gemm = sgemm_scratch(w.dcap + VB);
    float* accs = scratch_.base() + threads_ * per_thread_;
    w.acc = !acc_ ? nullptr : acc0_ ? (t == 0 ? acc0_ : accs + (t - 1) * acc_)
                                    : accs + t * acc_;
    return w;
  }

 private:
  int64_t M_, H_, tiles_, rows_, acc_;
  float* acc0_;
  int64_t per_thread_;
  int threads_;
  Scratch scratch_;
};

// Logits of block b into w.s and its weight rows into w.wblock; returns the
// block's first row and length. Only packed weights are converted.
std::pair<int64_t, int64_t> block_logits(const HeadProblem& p, const MatView& h,
                                         int64_t b, Work& w) {
  const int64_t v0 = b * VB, n = std::min(VB, p.V - v0);
  if (p.cfg.quantized) {
    dequant_rows(p, v0, n, w.wrows);
    w.wblock = {w.wrows, p.H, false, Elem::f32};
  } else {
    const Elem e = elem_of(p.w_dtype);
    const size_t size = e == Elem::f32 ? 4 : 2;
    w.wblock = {static_cast<const char*>(p.w) + v0 * p.H * size, p.H, false, e};
  }
  MatView wt = w.wblock;
  wt.trans = true;
  sgemm(p.M, n, p.H, h, wt, w.s, VB, false, w.gemm);
  return {v0, n};
}

// Runs fn(work, block) over all vocabulary blocks on a pool of threads.
template <class F>
void over_blocks(const HeadProblem& p, Workspace& ws, int threads, F&& fn) {
  const int64_t blocks = (p.V + VB - 1) / VB;
  std::atomic<int64_t> next{0};
  run_threads(threads, [&](int t) {
    Work w = ws.at(t);
    fn(w, -1); // per-thread setup
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      fn(w, b);
    }
  });
}

int threads_for(const HeadProblem& p) {
  return thread_count(p.cfg.tuning, (p.V + VB - 1) / VB);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread running entropy terms, relative to the thread's running maximum
// m: R = sum_v e^(s_v - m) (s_v - m), the sum of the logits, and the first
// arg-max. entropy = log S - R / S, with S the running sum: both terms are
// >= 0, so nothing cancels against lse.
struct RunStats {
  std::vector<float> r, total;
  std::vector<int32_t> arg;
  RunStats(int threads, int64_t M) : r(threads * M, 0.0f), total(threads * M, 0.0f),
                                     arg(threads * M, 0) {}
};

} // namespace

void forward(const HeadProblem& p, float* logp, float* lse, float* gsum,
             const StatsOut& st) {
  const int64_t M = p.M, H = p.H;
  const int T = threads_for(p);
  const bool stats = p.cfg.stats;
  const int tiles = stats && gsum ? 2 : 1;
  Workspace ws(T, p, gsum != nullptr, p.cfg.quantized, gsum ? std::max(VB, H) : VB,
               tiles == 1 ? gsum : nullptr, tiles);
  PackedH packed(p);
  const MatView hv = packed.view(p);
  std::vector<float> target_logit(M, std::numeric_limits<float>::quiet_NaN());
  RunStats rs(stats ? T : 0, M);
  const float cap = p.cfg.softcap;

  over_blocks(p, ws, T, [&](Work& w, int64_t b) {
    float *run_max = w.r0, *run_sum = w.r1;
    float* run_r = stats ? rs.r.data() + w.t * M : nullptr;
    if (b < 0) {
      std::fill(run_max, run_max + M, kNegInf);
      std::fill(run_sum, run_sum + M, 0.0f);
      if (w.acc) {
        std::fill(w.acc, w.acc + tiles * M * H, 0.0f);
      }
      return;
    }
    auto [v0, n] = block_logits(p, hv, b, w);
    for (int64_t m = 0; m < M; ++m) {
      float* row = w.s + m * VB;
      float* rel = tiles == 2 ? w.s + (M + m) * VB : nullptr;
      if (cap > 0) {
        softcap_inplace(row, w.acc ? w.dcap : nullptr, n, cap);
      }
      const int32_t y = p.targets[m];
      if (target_in(y, v0, n)) {
        target_logit[m] = row[y - v0];
      }
      float bmax;
      if (stats) {
        // The maximum, its first index and the logits' sum in one pass.
        const RowScan scan = scan_row(row, n);
        bmax = scan.max;
        rs.total[w.t * M + m] += scan.sum;
        if (bmax > run_max[m]) { // blocks come in increasing order per thread
          rs.arg[w.t * M + m] = static_cast<int32_t>(v0 + scan.arg);
        }
      } else {
        bmax = *std::max_element(row, row + n);
      }
      if (bmax > run_max[m]) {
        const float shrink = std::exp(run_max[m] - bmax);
        if (stats && run_sum[m] > 0) {
          // R relative to the new maximum: e^(m_old - m_new) (R + (m_old - m_new) S).
          run_r[m] = shrink * (run_r[m] + (run_max[m] - bmax) * run_sum[m]);
        }
        if (w.acc && shrink != 1.0f) {
          float* a = w.acc + m * H;
          if (tiles == 2 && run_sum[m] > 0) {
            const float d = run_max[m] - bmax;
            float* a2 = w.acc + (M + m) * H;
            for (int64_t i = 0; i < H; ++i) {
              a2[i] = shrink * (a2[i] + d * a[i]);
            }
          }
          for (int64_t i = 0; i < H; ++i) {
            a[i] *= shrink;
          }
        }
        run_sum[m] *= shrink;
        run_max[m] = bmax;
      }
      if (!w.acc) {
        run_sum[m] += stats ? exp_moments(row, nullptr, n, run_max[m], &run_r[m])
                            : sum_exp_shifted(row, n, run_max[m]);
        continue;
      }
      // Unnormalised softmax weights times dcap, for sum_v p_v dcap_v W_v
      // (and times s - m in the second tile, for the entropy's share).
      if (stats) {
        run_sum[m] += exp_moments(row, rel, n, run_max[m], &run_r[m]);
      } else {
        scaled_exp_shifted(row, n, run_max[m], 1.0f);
        float part = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          part += row[j];
        }
        run_sum[m] += part;
      }
      if (cap > 0) {
        for (int64_t j = 0; j < n; ++j) {
          row[j] *= w.dcap[j];
        }
        if (rel) {
          for (int64_t j = 0; j < n; ++j) {
            rel[j] *= w.dcap[j];
          }
        }
      }
    }
    if (w.acc) {
      sgemm(tiles * M, H, n, {w.s, VB}, w.wblock, w.acc, H, true, w.gemm);
    }
  });

  // Merge the threads' running (max, sum) and weighted rows.
  const std::vector<Work> works = ws.all();
  std::vector<float> weight(T);
  for (int64_t m = 0; m < M; ++m) {
    float gmax = kNegInf;
    for (auto& w : works) {
      gmax = std::max(gmax, w.r0[m]);
    }
    double total = 0.0, r = 0.0, logits = 0.0;
    int32_t arg = std::numeric_limits<int32_t>::max();
    for (int t = 0; t < T; ++t) {
      const float mt = works[t].r0[m];
      weight[t] = mt > kNegInf ? std::exp(mt - gmax) : 0.0f;
      total += double(works[t].r1[m]) * weight[t];
      if (stats) {
        logits += rs.total[t * M + m];
        if (mt > kNegInf) {
          r += double(weight[t]) * (rs.r[t * M + m] + double(mt - gmax) * works[t].r1[m]);
        }
        if (mt == gmax) { // the first arg-max: the smallest index at the maximum
          arg = std::min(arg, rs.arg[t * M + m]);
        }
      }
    }
    lse[m] = gmax + static_cast<float>(std::log(total));
    const int32_t y = p.targets[m];
    logp[m] = y == p.cfg.ignore_index ? 0.0f : target_logit[m] - lse[m];
    const double r_over_s = r / total; // sum_v p_v s_v - gmax
    if (stats) {
      st.entropy[m] = static_cast<float>(std::log(total) - r_over_s);
      st.top1[m] = y == arg && y != p.cfg.ignore_index;
      st.mean[m] = static_cast<float>(logits / double(p.V));
    }
    if (!gsum) {
      continue;
    }
    // Thread 0 accumulated in gsum itself (with one tile): scale it, then add
    // the others.
    float* out = gsum + m * H;
    const float c0 = static_cast<float>(weight[0] / total);
    if (tiles == 1) {
      for (int64_t i = 0; i < H; ++i) {
        out[i] *= c0;
      }
    } else {
      std::fill(out, out + H, 0.0f);
    }
    for (int t = tiles == 1 ? 1 : 0; t < T; ++t) {
      const float c = static_cast<float>(weight[t] / total);
      const float* a = works[t].acc + m * H;
      for (int64_t i = 0; i < H; ++i) {
        out[i] += c * a[i];
      }
    }
    if (tiles == 2) {
      // gsum_ent = sum_v p_v (s_v - gmax) dcap_v W_v - (sum p s - gmax) gsum,
      // each thread's rows moved from its maximum to gmax first.
      float* ent = st.gsum_ent + m * H;
      std::fill(ent, ent + H, 0.0f);
      for (int t = 0; t < T; ++t) {
        const float mt = works[t].r0[m];
        if (!(mt > kNegInf)) {
          continue;
        }
        const float c = static_cast<float>(weight[t] / total), d = mt - gmax;
        const float *a = works[t].acc + m * H, *a2 = works[t].acc + (M + m) * H;
        for (int64_t i = 0; i < H; ++i) {
          ent[i] += c * (a2[i] + d * a[i]);
        }
      }
      const float rs_f = static_cast<float>(r_over_s);
      for (int64_t i = 0; i < H; ++i) {
        ent[i] -= rs_f * out[i];
      }
    }
  }
}

void backward(const HeadProblem& p, const float* lse, const float* g,
              const float* g_lse, void* dh, void* dw, const EntropyGrad& ent) {
  const int64_t M = p.M, H = p.H, V = p.V;
  const int T = threads_for(p);
  Workspace ws(T, p, true, p.cfg.quantized || dw != nullptr, std::max(VB, H));
  PackedH packed(p);
  const MatView hv = packed.view(p);
  const float cap = p.cfg.softcap;
  const Elem w_elem = elem_of(p.w_dtype);

  over_blocks(p, ws, T, [&](Work& w, int64_t b) {
    float *gm = w.r0, *coef = w.r1;
    if (b < 0) {
      std::fill(w.acc, w.acc + M * H, 0.0f);
      // Ignored and out-of-range rows take no gradient through logp.
      for (int64_t m = 0; m < M; ++m) {
        const int32_t y = p.targets[m];
        const bool ok = y != p.cfg.ignore_index && y >= 0 && y < V;
        gm[m] = ok ? g[m] : 0.0f;
        coef[m] = g_lse[m] - gm[m];
      }
      return;
    }
    auto [v0, n] = block_logits(p, hv, b, w);
    // dS = (g * onehot + (g_lse - g) * softmax) * dcap, in place; the entropy
    // adds -g_ent p_v (s_v - sum_u p_u s_u) dcap_v, sum_u p_u s_u = lse - entropy.
    for (int64_t m = 0; m < M; ++m) {
      float* row = w.s + m * VB;
      if (cap > 0) {
        softcap_inplace(row, w.dcap, n, cap);
      }
      if (ent.g_ent) {
        exp_affine(row, n, lse[m], coef[m], ent.g_ent[m], lse[m] - ent.entropy[m]);
      } else {
        scaled_exp_shifted(row, n, lse[m], coef[m]);
      }
      const int32_t y = p.targets[m];
      if (target_in(y, v0, n)) {
        row[y - v0] += gm[m];
      }
      if (cap > 0) {
        for (int64_t j = 0; j < n; ++j) {
          row[j] *= w.dcap[j];
        }
      }
    }
    sgemm(M, H, n, {w.s, VB}, w.wblock, w.acc, H, true, w.gemm);
    if (dw) {
      // dW rows = dS^T @ h, staged in wrows (done with the weight now).
      sgemm(n, H, M, {w.s, VB, true}, h_view(p), w.wrows, H, false, w.gemm);
      for (int64_t i = 0; i < n * H; ++i) {
        store(dw, w_elem, v0 * H + i, w.wrows[i]);
      }
    }
  });

  const Elem h_elem = elem_of(p.h_dtype);
  const std::vector<Work> works = ws.all();
  for (int64_t i = 0; i < M * H; ++i) {
    float acc = 0.0f;
    for (auto& w : works) {
      acc += w.acc[i];
    }
    store(dh, h_elem, i, acc);
  }
}

void fused_dh(const HeadProblem& p, const float* gsum, const float* logp, const float* lse,
              const float* g, const float* g_lse, void* dh, const float* gsum_ent,
              const float* g_ent) {
  const int64_t H = p.H;
  const Elem h_elem = elem_of(p.h_dtype), w_elem = elem_of(p.w_dtype);
  const float cap = p.cfg.softcap;
  std::vector<float> wy(H);
  for (int64_t m = 0; m < p.M; ++m) {
    const int32_t y = p.targets[m];
    const bool ok = y != p.cfg.ignore_index && y >= 0 && y < p.V;
    const float gm = ok ? g[m] : 0.0f;
    float coef_y = gm;
    if (ok && cap > 0) {
      const float t = (logp[m] + lse[m]) / cap; // s_y / cap = tanh(raw / cap)
      coef_y *= 1.0f - t * t;
    }
    const float coef_rest = g_lse[m] - gm;
    if (ok) {
      if (p.cfg.quantized) {
        dequant_rows(p, y, 1, wy.data());
      } else {
        for (int64_t i = 0; i < H; ++i) {
          wy[i] = load(p.w, w_elem, int64_t(y) * H + i);
        }
      }
    }
    const float* gs = gsum + m * H;
    const float* ge = gsum_ent ? gsum_ent + m * H : nullptr;
    const float coef_ent = ge ? g_ent[m] : 0.0f;
    for (int64_t i = 0; i < H; ++i) {
      float v = coef_rest * gs[i] + (ok ? coef_y * wy[i] : 0.0f);
      if (ge) {
        v -= coef_ent * ge[i];
      }
      store(dh, h_elem, m * H + i, v);
    }
  }
}

} // namespace flash_cce::cpu
