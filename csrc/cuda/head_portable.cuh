// Portable kernels' bodies (sm_80 and later: mma.sync tensor cores, cp.async
// pipelines).
//
// One GEMM main loop, C[128 x 128] = A[128 x K] . B[128 x K]^T with A and B
// each stored K-major or MN-major, feeds four epilogues:
//   fwd  logits -> softcap -> per-row online (max, sum) and target logit
//        (fwd_ent: also the entropy statistics' partials)
//   ds   logits -> dS = (g onehot + (g_lse - g) softmax) dcap, stored
//        (ds_ent: with the entropy's share)
//   dh   dh (+)= dS @ W_chunk
//   dw   dW_chunk = dS^T @ h
// Quantized heads are dequantized by the B loader into shared memory.
#pragma once

#include "device.cuh"

namespace flash_cce::cuda {

namespace {

// Forward ------------------------------------------------------------------------

// STATS (the fwd_ent kernels): also the entropy statistics' partials, each
// tile's relative to its own maximum and merged into the running ones.
template <class T, int QB, bool STATS = false>
__device__ __forceinline__ void fwd_body(const FwdParams& p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float red_max[4][BM], red_sum[4][BM];
  // The entropy partials' reduction over the column warps (STATS only).
  __shared__ float red_r[STATS ? 4 : 1][BM], red_tot[STATS ? 4 : 1][BM];
  __shared__ int32_t red_arg[STATS ? 4 : 1][BM];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const auto [mt, split] = fwd_block(p, blockIdx.x);
  const int64_t m0 = int64_t(mt) * BM;
  const int t_begin = split * p.tiles_per_split;
  const int t_end = min(p.v_tiles, t_begin + p.tiles_per_split);
  const Frag f;

  int32_t y[8];
  float run_max[8], run_sum[8];
  float run_r[8], run_tot[8];
  int32_t run_arg[8];
#pragma unroll
  for (int ri = 0; ri < 8; ++ri) {
    const int64_t gm = m0 + f.row(ri >> 1, (ri & 1) * 2);
    y[ri] = gm < p.M ? p.targets[gm] : -1;
    run_max[ri] = -INFINITY;
    run_sum[ri] = 0.0f;
    run_r[ri] = 0.0f;
    run_tot[ri] = 0.0f;
    run_arg[ri] = INT32_MAX;
  }

  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
  float acc[4][4][4];
  for (int vt = t_begin; vt < t_end; ++vt) {
    const int64_t v0 = int64_t(vt) * BN;
    gemm_tile<T, true, true, QB>(p.h, p.w, m0, v0, p.H, acc, smem);
#pragma unroll
    for (int ri = 0; ri < 8; ++ri) {
      const int mi = ri >> 1, e0 = (ri & 1) * 2;
      const int64_t gm = m0 + f.row(mi, e0);
      float tmax = -INFINITY, ttot = 0.0f;
      int32_t targ = INT32_MAX;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t v = v0 + f.col(ni, j);
          float s = acc[mi][ni][e0 + j];
          if (p.cap > 0.0f) {
            s = p.cap * tanh_fast(s * inv_cap);
          }
          if (v >= p.V) {
            s = -INFINITY;
          } else if (v == y[ri] && gm < p.M) {
            p.target_logit[gm] = s;
          }
          acc[mi][ni][e0 + j] = s;
          if constexpr (STATS) {
            // A thread's columns come in increasing order: > keeps the first.
            if (s > tmax) {
              tmax = s;
              targ = static_cast<int32_t>(v);
            }
            ttot += v < p.V ? s : 0.0f;
          } else {
            tmax = fmaxf(tmax, s);
          }
        }
      if (tmax == -INFINITY) {
        continue;
      }
      if constexpr (STATS) {
        // The tile's sums relative to its own maximum (masked columns give
        // e = 0 against d = -inf: d is clamped so that the product is 0).
        float sum = 0.0f, r = 0.0f;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float d = acc[mi][ni][e0 + j] - tmax;
            const float e = exp_ftz(d);
            sum += e;
            r = fmaf(e, fmaxf(d, -FLT_MAX), r);
          }
        merge_arg(run_arg[ri], run_max[ri], targ, tmax);
        merge_ent(run_max[ri], run_sum[ri], run_r[ri], tmax, sum, r);
        run_tot[ri] += ttot;
        continue;
      }
      const float nm = fmaxf(run_max[ri], tmax);
      float sum = 0.0f;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          sum += exp_ftz(acc[mi][ni][e0 + j] - nm);
      run_sum[ri] = run_sum[ri] * exp_ftz(run_max[ri] - nm) + sum;
      run_max[ri] = nm;
    }
  }

  // Reduce over the 4 lanes that share a row, then over the 4 column warps.
#pragma unroll
  for (int ri = 0; ri < 8; ++ri) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      const float om = __shfl_xor_sync(0xffffffff, run_max[ri], off);
      const float ol = __shfl_xor_sync(0xffffffff, run_sum[ri], off);
      if constexpr (STATS) {
        const float o_r = __shfl_xor_sync(0xffffffff, run_r[ri], off);
        run_tot[ri] += __shfl_xor_sync(0xffffffff, run_tot[ri], off);
        merge_arg(run_arg[ri], run_max[ri], __shfl_xor_sync(0xffffffff, run_arg[ri], off), om);
        merge_ent(run_max[ri], run_sum[ri], run_r[ri], om, ol, o_r);
      } else {
        merge(run_max[ri], run_sum[ri], om, ol);
      }
    }
    if ((f.lane & 3) == 0) {
      const int r = f.row(ri >> 1, (ri & 1) * 2);
      red_max[f.wn][r] = run_max[ri];
      red_sum[f.wn][r] = run_sum[ri];
      if constexpr (STATS) {
        red_r[f.wn][r] = run_r[ri];
        red_tot[f.wn][r] = run_tot[ri];
        red_arg[f.wn][r] = run_arg[ri];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < BM) {
    const int r = threadIdx.x;
    float m = red_max[0][r], l = red_sum[0][r];
    float rr = STATS ? red_r[0][r] : 0.0f, tot = STATS ? red_tot[0][r] : 0.0f;
    int32_t arg = STATS ? red_arg[0][r] : 0;
    for (int w = 1; w < 4; ++w) {
      if constexpr (STATS) {
        merge_arg(arg, m, red_arg[w][r], red_max[w][r]);
        merge_ent(m, l, rr, red_max[w][r], red_sum[w][r], red_r[w][r]);
        tot += red_tot[w][r];
      } else {
        merge(m, l, red_max[w][r], red_sum[w][r]);
      }
    }
    const int64_t gm = m0 + r;
    if (gm < p.M) {
      const int64_t i = int64_t(split) * p.M + gm;
      p.part_max[i] = m;
      p.part_sum[i] = l;
      if constexpr (STATS) {
        p.part_r[i] = rr;
        p.part_tot[i] = tot;
        p.part_arg[i] = arg;
      }
    }
  }
}

// Backward: dS -------------------------------------------------------------------

// The fused forward's epilogue: P tile to ds, row statistics to part_*[vt, M].
template <class T>
__device__ __forceinline__ void fwd_p_epilogue(const DsParams& p, float (&acc)[4][4][4],
                                               int64_t m0, int64_t v0, int vt,
                                               float (&red)[2][4][BM]) {
  const Frag f;
  T* ds = static_cast<T*>(p.ds);
  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
#pragma unroll
  for (int ri = 0; ri < 8; ++ri) {
    const int mi = ri >> 1, e0 = (ri & 1) * 2;
    const int64_t gm = m0 + f.row(mi, e0);
    const int32_t y = gm < p.M ? p.targets[gm] : -1;
    const float ref = row_ref(p, gm);
    float sum = 0.0f, tmax = -INFINITY;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      float d[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        d[j] = p_value(acc[mi][ni][e0 + j], v0 + f.col(ni, j), y, p.V, p.cap, inv_cap, ref,
                       p.target_logit + gm, sum, tmax);
      }
      const int64_t c = v0 - p.v0 + f.col(ni, 0);
      if (gm < p.M && c < p.width) {
        *reinterpret_cast<uint32_t*>(ds + gm * p.ld_ds + c) = pack2<T>(d[0], d[1]);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      sum += __shfl_xor_sync(0xffffffff, sum, off);
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, off));
    }
    if ((f.lane & 3) == 0) {
      red[0][f.wn][f.row(mi, e0)] = sum;
      red[1][f.wn][f.row(mi, e0)] = tmax;
    }
  }
  __syncthreads();
  if (threadIdx.x < BM && m0 + threadIdx.x < p.M) {
    const int r = threadIdx.x;
    put_row_stats(p, vt, m0 + r, red[0][0][r] + red[0][1][r] + red[0][2][r] + red[0][3][r],
                  fmaxf(fmaxf(red[1][0][r], red[1][1][r]), fmaxf(red[1][2][r], red[1][3][r])));
  }
}

// ENT (the ds_ent kernels): dS with the entropy's share (ds_value).
template <class T, int QB, bool ENT = false>
__device__ __forceinline__ void ds_body(const DsParams& p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float red[2][4][BM];
  if (p.guard && *p.guard == 0) {
    return;
  }
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int mt = blockIdx.x % p.m_tiles, vt = blockIdx.x / p.m_tiles;
  const int64_t m0 = int64_t(mt) * BM, v0 = p.v0 + int64_t(vt) * BN;
  const Frag f;
  float acc[4][4][4];
  gemm_tile<T, true, true, QB>(p.h, p.w, m0, v0, p.H, acc, smem);
  if (p.part_sum) {
    fwd_p_epilogue<T>(p, acc, m0, v0, vt, red);
    return;
  }

  T* ds = static_cast<T*>(p.ds);
  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
#pragma unroll
  for (int ri = 0; ri < 8; ++ri) {
    const int mi = ri >> 1, e0 = (ri & 1) * 2;
    const int64_t gm = m0 + f.row(mi, e0);
    if (gm >= p.M) {
      continue;
    }
    const DsRow r = ds_row<ENT>(p, gm);
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      float d[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        d[j] = ds_value<ENT>(acc[mi][ni][e0 + j], v0 + f.col(ni, j), r, p.V, p.cap, inv_cap);
      }
      const int64_t c = v0 - p.v0 + f.col(ni, 0);
      if (c < p.width) {
        *reinterpret_cast<uint32_t*>(ds + gm * p.ld_ds + c) = pack2<T>(d[0], d[1]);
      }
    }
  }
}

// Backward: dh ---------------------------------------------------------------------

template <class T, int QB>
__device__ __forceinline__ void dh_body(const DhParams& p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (p.guard && *p.guard == 0) {
    return;
  }
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int mt = blockIdx.x % p.m_tiles, ht = blockIdx.x / p.m_tiles;
  const int64_t m0 = int64_t(mt) * BM, n0 = int64_t(ht) * BN;
  const Frag f;
  float acc[4][4][4];
  gemm_tile<T, true, false, QB>(p.ds, p.w, m0, n0, p.ds.cols, acc, smem);
  if (ht == 0 && threadIdx.x < BM) {
    add_row_sums(p, m0 + threadIdx.x);
  }

#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t gm = m0 + f.row(mi, hf * 2);
      if (gm >= p.M) {
        continue;
      }
      const float scale = row_scale(p, gm);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int64_t c = n0 + f.col(ni, 0);
        if (c >= p.H) {
          continue;
        }
        dh_update(p, gm, c, acc[mi][ni][hf * 2], acc[mi][ni][hf * 2 + 1], scale, p.first,
                  p.last);
      }
    }
}

// Backward: dW ---------------------------------------------------------------------

template <class T>
__device__ __forceinline__ void dw_body(const DwParams& p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int vt = blockIdx.x % p.v_tiles, ht = blockIdx.x / p.v_tiles;
  const int64_t r0 = int64_t(vt) * BM, n0 = int64_t(ht) * BN;
  const Frag f;
  float acc[4][4][4];
  gemm_tile<T, false, false, 0>(p.ds, p.h, r0, n0, p.M, acc, smem);
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t r = r0 + f.row(mi, e), c = n0 + f.col(ni, e);
        if (r < p.width && c < p.H) {
          store_from_float(p.out, p.out_kind, (p.v0 + r) * p.H + c, acc[mi][ni][e]);
        }
      }
}

} // namespace

} // namespace flash_cce::cuda
