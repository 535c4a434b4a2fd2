// The head's tile loop. A threadgroup owns BM rows of h and a contiguous range
// of BN-row vocabulary blocks (one split), taken in groups of
// FCCE_GROUP_BLOCKS. Per block of a group:
//   1. logits S [BM, BN] = h W^T over H with steel's BlockMMA (h and w tiles
//      of the head's tile type T from steel's loaders, metal/loaders.h; float
//      accumulators), stored to the block's float tile in threadgroup memory;
//   2. a row epilogue (4 threads per row, 8 columns each): softcap, then
//      - FWD / FWD_FUSED: the online (max, sum of exp) of the row and the
//        target's logit; FWD_FUSED keeps C = exp(s - max) dcap (and rescales
//        the group's earlier tiles when the maximum moves);
//      - DH: C = dS = (g [v == y] + (g_lse - g) exp(s - lse)) dcap;
// then, per group,
//   3. FWD_FUSED / DH: part_acc[split, rows, :] = factor * part_acc + sum of
//      the group's C W, H in BK-column pieces (factor rescales the earlier
//      groups to the new row maximum; 1 for DH): the partial is read and
//      written once per group.
// The split's row statistics go to part_max / part_sum at the end. Only the
// [splits, M] statistics and the [splits, M, H] partials reach device memory.
// A launch runs one round of each split's blocks (FcceParams::block_begin,
// block_count); a round after the first resumes from those statistics and
// partials, so a long split is several bounded launches.
// The plan runs the fused forward and dh with their accumulator in registers
// (metal/regs.h, which reuses this file's pieces); the FWD_FUSED and DH modes
// here remain for Problem::acc_registers = -1.
#pragma once

namespace fcce {

// The running-maximum sentinel: finite, so that exp(sentinel - x) is 0, never NaN.
constant constexpr float kFloorLogit = -3.0e38f;
constant constexpr int kLdC = FCCE_BN + 4; // row stride of the coefficient tile
constant constexpr int kNoArg = 0x7fffffff; // above every column: no arg-max yet

template <typename T>
using LogitMMA = mlx::steel::BlockMMA<
    T, float, FCCE_BM, FCCE_BN, FCCE_BK, FCCE_WM, FCCE_WN,
    false, true, FCCE_TILE_LD(sizeof(T)), FCCE_TILE_LD(sizeof(T))>;
// C [BM, BN] (float) times a w tile [BN, BK] of T (rows v, columns of H),
// through mma_mixed.
template <typename T>
using AccMMA = mlx::steel::BlockMMA<
    float, float, FCCE_BM, FCCE_BK, FCCE_BN, FCCE_WM, FCCE_WN,
    false, false, kLdC, FCCE_TILE_LD(sizeof(T))>;

constant constexpr int kTileC = FCCE_BM * kLdC; // floats of one coefficient tile

// steel's BlockMMA::mma for operands of two element types (the float
// coefficient tile times a T tile of w or h): the same fragment loads and
// tile_matmad over a reduction of K, each operand read in its own type and
// converted to the float fragments.
template <short K, typename TA, typename TB, class MMA>
METAL_FUNC void mma_mixed(thread MMA& mma, const threadgroup TA* As, const threadgroup TB* Bs) {
  As += mma.As_offset;
  Bs += mma.Bs_offset;
  for (short kk = 0; kk < K; kk += 8) {
    simdgroup_barrier(mem_flags::mem_none);
    mma.Atile.template load<TA, FCCE_WM, 1, MMA::A_str_m, MMA::A_str_k>(As);
    simdgroup_barrier(mem_flags::mem_none);
    mma.Btile.template load<TB, 1, FCCE_WN, MMA::B_str_k, MMA::B_str_n>(Bs);
    simdgroup_barrier(mem_flags::mem_none);
    mlx::steel::tile_matmad(mma.Ctile, mma.Atile, mma.Btile, mma.Ctile);
    As += MMA::tile_stride_a;
    Bs += MMA::tile_stride_b;
  }
}

// Threadgroup memory of the head kernel (plan.cpp's head_threadgroup_bytes):
// the h and w tiles of T, then the float coefficient tiles and row factors.
template <typename T>
struct HeadSmem {
  threadgroup T* hs; // [BM, FCCE_TILE_LD(sizeof(T))] h tile
  threadgroup T* ws; // [BN, FCCE_TILE_LD(sizeof(T))] w tile
  threadgroup float* cs; // FCCE_GROUP_BLOCKS x [BM, kLdC] logits, then coefficients
  threadgroup float* factor; // [BM] per-row rescale of the partials

  METAL_FUNC HeadSmem(threadgroup float* smem)
      : hs((threadgroup T*)smem),
        ws((threadgroup T*)smem + FCCE_BM * FCCE_TILE_LD(sizeof(T))),
        cs(smem + FCCE_HW_FLOATS(sizeof(T))),
        factor(smem + FCCE_HW_FLOATS(sizeof(T)) + FCCE_GROUP_BLOCKS * kTileC) {}
};

// S = h[m0 : m0 + BM] w[v0 : v0 + BN]^T into the tile cs.
template <typename HT, class W>
METAL_FUNC void logits_tile(
    const device HT* h, thread const W& w, const constant FcceParams& p,
    int m0, int v0, threadgroup float* cs, thread const HeadSmem<typename W::Tile>& sm,
    uint sgid, uint lane) {
  using T = typename W::Tile;
  LogitMMA<T> mma(sgid, lane);
  for (int k0 = 0; k0 < p.H; k0 += FCCE_BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DenseTile<HT, T>::load(h, p.M, p.H, m0, k0, sm.hs, sgid, lane);
    w.load(p, v0, k0, sm.ws, sgid, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma.mma(sm.hs, sm.ws);
  }
  mma.Ctile.template store<float, FCCE_WM, FCCE_WN, kLdC, 1>(
      cs + mma.sm * kLdC + mma.sn);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Softcaps the thread's 8 logits in place; dcap receives d(cap tanh(x/cap))/dx.
METAL_FUNC void softcap8(thread float* s, thread float* dcap, float cap) {
  for (int j = 0; j < 8; ++j) {
    if (cap > 0.0f) {
      const float t = metal::precise::tanh(s[j] / cap);
      s[j] = cap * t;
      dcap[j] = 1.0f - t * t;
    } else {
      dcap[j] = 1.0f;
    }
  }
}

// One row's target: whether the row exists, its target and whether that
// takes a gradient (not ignored, inside [0, V)).
struct RowTarget {
  bool ok;
  int y;
  bool y_ok;
};

METAL_FUNC RowTarget row_target(const constant FcceParams& p, const device int* targets, int m) {
  RowTarget t;
  t.ok = m < p.M;
  t.y = t.ok ? targets[m] : -1;
  t.y_ok = t.ok && t.y != p.ignore_index && t.y >= 0 && t.y < p.V;
  return t;
}

// The backward's per-row factors: g masked by the target, g_lse - g, lse;
// with the entropy's cotangent also g_ent and zbar = sum_u p_u s_u = lse - entropy.
struct RowGrad {
  float gm;
  float coef;
  float lse;
  float ge;
  float zbar;
};

// The entropy's inputs of the backward: the forward's entropy and its
// cotangent, [M] each (null without the entropy).
struct EntGrad {
  const device float* entropy;
  const device float* g_ent;
};

METAL_FUNC RowGrad row_grad(
    thread const RowTarget& t, const device float* lse, const device float* g,
    const device float* g_lse, int m, EntGrad ent = EntGrad{nullptr, nullptr}) {
  RowGrad r{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (t.ok) {
    r.gm = t.y_ok ? g[m] : 0.0f;
    r.coef = g_lse[m] - r.gm;
    r.lse = lse[m];
    if (ent.g_ent) {
      r.ge = ent.g_ent[m];
      r.zbar = r.lse - ent.entropy[m];
    }
  }
  return r;
}

// The thread's 8 logits from the tile, softcapped; dcap receives the softcap's
// derivative. (A temperature reaches the kernels folded into h and the cap.)
METAL_FUNC void read_logits8(threadgroup float* crow, thread float* s, thread float* dcap,
                             float cap) {
  for (int j = 0; j < 8; ++j) {
    s[j] = crow[j];
  }
  softcap8(s, dcap, cap);
}

// dS = (g [v == y] + (g_lse - g) exp(s - lse)) dcap for columns v0 ... v0 + 7,
// written over the logits; 0 for columns past V and rows past M. kEnt adds
// the entropy's share -g_ent p_v (s_v - zbar) dcap_v (its gradient with
// respect to s_v is -p_v (s_v - zbar)).
template <bool kEnt = false>
METAL_FUNC void write_ds8(threadgroup float* crow, thread const float* s,
                          thread const float* dcap, int v0, const constant FcceParams& p,
                          thread const RowTarget& t, thread const RowGrad& r) {
  for (int j = 0; j < 8; ++j) {
    const int v = v0 + j;
    float c = r.coef;
    if (kEnt) {
      c -= r.ge * (s[j] - r.zbar);
    }
    float d = v < p.V && t.ok ? c * metal::precise::exp(s[j] - r.lse) : 0.0f;
    d += t.y_ok && v == t.y ? r.gm : 0.0f;
    crow[j] = d * dcap[j];
  }
}

// Sum (or max) over the 4 threads of a row: lanes 4r ... 4r + 3 of one SIMD group.
METAL_FUNC float row_sum4(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(2));
}
METAL_FUNC float row_max4(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(2)));
}
METAL_FUNC int row_min4(int x) {
  x = min(x, simd_shuffle_xor(x, ushort(1)));
  return min(x, simd_shuffle_xor(x, ushort(2)));
}

// The entropy statistics of one row over the blocks seen so far, beside its
// running (max, sum): r = sum_v exp(s_v - max) (s_v - max), relative to the
// running maximum like the sum (entropy = log sum - r / sum: both terms >= 0,
// nothing cancels against lse), the sum of the logits, and the first arg-max.
struct RowEnt {
  float r;
  float lsum;
  int arg;
};

// The forward's per-split entropy statistics in device memory ([splits, M]
// each; null in kernels without the entropy).
struct EntParts {
  device float* r;
  device float* lsum;
  device int* arg;
};

// The forward's row epilogue of one block for the thread's 8 logits s of
// columns v0 ... v0 + 7 (softcapped): the target's logit, the row's online
// (run_max, run_sum) moved past this block, and with kCoef the coefficients
// crow = exp(s - new max) dcap. kEnt moves the entropy statistics `ent` alike:
// r is rescaled to the new maximum as exp(old - new) (r + (old - new) sum).
// Returns exp(old max - new max), the factor that rescales sums taken at the
// old maximum.
template <bool kCoef, bool kEnt = false>
METAL_FUNC float online_row8(
    threadgroup float* crow, thread float* s, thread const float* dcap, int v0,
    const constant FcceParams& p, thread const RowTarget& t, device float* target_logit,
    int m, thread float& run_max, thread float& run_sum, thread RowEnt& ent) {
  float bmax = kFloorLogit, lsum = 0.0f;
  int barg = kNoArg; // this thread's first column at its maximum
  for (int j = 0; j < 8; ++j) {
    const int v = v0 + j;
    if (t.y_ok && v == t.y) {
      target_logit[m] = s[j];
    }
    s[j] = v < p.V ? s[j] : kFloorLogit;
    if (kEnt && v < p.V) {
      lsum += s[j];
      barg = s[j] > bmax ? v : barg;
    }
    bmax = max(bmax, s[j]);
  }
  const float row_bmax = row_max4(bmax);
  const float new_max = max(run_max, row_bmax);
  const float f = metal::precise::exp(run_max - new_max);
  float part_e = 0.0f, part_r = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const float e = metal::precise::exp(s[j] - new_max);
    part_e += e;
    if (kEnt) {
      part_r += e * (s[j] - new_max); // 0 past V: e is 0, s - new_max finite
    }
    if (kCoef) {
      crow[j] = e * dcap[j];
    }
  }
  if (kEnt) {
    // The block's first arg-max; it replaces the row's only where the
    // maximum grows strictly (blocks come in increasing order).
    const int arg = row_min4(bmax == row_bmax ? barg : kNoArg);
    ent.arg = row_bmax > run_max ? arg : ent.arg;
    ent.r = f * (ent.r + (run_max - new_max) * run_sum) + row_sum4(part_r);
    ent.lsum += row_sum4(lsum);
  }
  run_sum = run_sum * f + row_sum4(part_e);
  run_max = new_max;
  return f;
}

// part[rows, :] = factor[row] * part[rows, :] (skipped for the split's first
// group) + the sum over the group's `count` blocks (from vb) of their
// coefficient tiles times their rows of w, H in BK-wide pieces.
template <class W>
METAL_FUNC void accumulate_cw(
    thread const W& w, const constant FcceParams& p, device float* part,
    int m0, int vb, int count, bool first, bool rescale,
    thread const HeadSmem<typename W::Tile>& sm, uint sgid, uint lane) {
  using T = typename W::Tile;
  const short rows = short(min(FCCE_BM, p.M - m0));
  for (int i0 = 0; i0 < p.H; i0 += FCCE_BK) {
    AccMMA<T> acc(sgid, lane);
    const short2 dims(short(min(FCCE_BK, p.H - i0)), rows);
    device float* dst = part + i0;
    for (int b = 0; b < count; ++b) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      w.load(p, (vb + b) * FCCE_BN, i0, sm.ws, sgid, lane);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (b == 0 && !first) {
        acc.Ctile.template load_safe<float, FCCE_WM, FCCE_WN>(
            dst + acc.sm * p.H + acc.sn, p.H, dims - short2(acc.sn, acc.sm));
        if (rescale) {
          for (short i = 0; i < decltype(acc.Ctile)::kTileRows; ++i) {
            const float f = sm.factor[acc.sm + i * 8 * FCCE_WM];
            for (short j = 0; j < decltype(acc.Ctile)::kTileCols; ++j) {
              acc.Ctile.frag_at(i, j) *= f;
            }
          }
        }
      }
      mma_mixed<FCCE_BN>(acc, sm.cs + b * kTileC, sm.ws);
    }
    acc.store_result_safe(dst, p.H, dims);
  }
}

// A head threadgroup's work in this launch: its split, its first row of h, and
// the split's blocks of this round [vb0, vb1) (a round [block_begin,
// + block_count); a later round resumes the split's statistics and partial
// sums). grid.x runs over m tiles, so that threadgroups in flight share W's tiles.
struct HeadRound {
  int split, m0, split_vb0, vb0, vb1;

  METAL_FUNC HeadRound(const constant FcceParams& p, uint3 group)
      : split(p.split_begin + int(group.y)),
        m0((p.m_tile_begin + int(group.x)) * FCCE_BM),
        split_vb0(split * p.blocks_per_split),
        vb0(split_vb0 + p.block_begin),
        vb1(min(min(vb0 + p.block_count, split_vb0 + p.blocks_per_split),
                (p.V + FCCE_BN - 1) / FCCE_BN)) {}
};

template <int MODE, bool kEnt = false, typename HT, class W>
METAL_FUNC void head_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* part_max, device float* part_sum, device float* target_logit,
    device float* part_acc, const constant FcceParams& p, threadgroup float* smem,
    uint3 group, uint tid, uint sgid, uint lane, EntParts ent_parts = EntParts{}) {
  const HeadSmem<typename W::Tile> sm(smem);
  const HeadRound rd(p, group);
  const int split = rd.split, m0 = rd.m0, split_vb0 = rd.split_vb0, vb0 = rd.vb0, vb1 = rd.vb1;

  // This thread's row and columns in the epilogue.
  const int er = int(tid) / 4, ec = int(tid % 4) * 8, m = m0 + er;
  const RowTarget t = row_target(p, targets, m);
  const RowGrad r = MODE == FCCE_MODE_DH ? row_grad(t, lse, g, g_lse, m) : RowGrad{};
  float run_max = kFloorLogit, run_sum = 0.0f;
  RowEnt ent{0.0f, 0.0f, kNoArg};
  const int at = split * p.M + m; // this row's entry of the split's statistics
  if (MODE != FCCE_MODE_DH && p.block_begin > 0 && t.ok) {
    run_max = part_max[at];
    run_sum = part_sum[at];
    if (kEnt) {
      ent = RowEnt{ent_parts.r[at], ent_parts.lsum[at], ent_parts.arg[at]};
    }
  }
  device float* part = MODE == FCCE_MODE_FWD
      ? part_acc
      : part_acc + (size_t(split) * size_t(p.M) + size_t(m0)) * size_t(p.H);

  for (int g0 = vb0; g0 < vb1; g0 += FCCE_GROUP_BLOCKS) {
    const int count = min(FCCE_GROUP_BLOCKS, vb1 - g0);
    const float group_max = run_max; // the partial's scale before this group
    for (int b = 0; b < count; ++b) {
      const int v0 = (g0 + b) * FCCE_BN;
      threadgroup float* cs = sm.cs + b * kTileC;
      logits_tile(h, w, p, m0, v0, cs, sm, sgid, lane);

      threadgroup float* crow = cs + er * kLdC + ec;
      float s[8], dcap[8];
      read_logits8(crow, s, dcap, p.softcap);
      if (MODE == FCCE_MODE_DH) {
        write_ds8(crow, s, dcap, v0 + ec, p, t, r);
      } else {
        const float f = online_row8<MODE == FCCE_MODE_FWD_FUSED, kEnt>(
            crow, s, dcap, v0 + ec, p, t, target_logit, m, run_max, run_sum, ent);
        if (MODE == FCCE_MODE_FWD_FUSED) {
          // The group's earlier coefficients (this thread's own entries) to the new maximum.
          for (int bb = 0; bb < b; ++bb) {
            for (int j = 0; j < 8; ++j) {
              crow[(bb - b) * kTileC + j] *= f;
            }
          }
        }
      }
    }
    if (MODE != FCCE_MODE_FWD) {
      if (MODE == FCCE_MODE_FWD_FUSED && ec == 0) {
        sm.factor[er] = metal::precise::exp(group_max - run_max);
      }
      accumulate_cw(w, p, part, m0, g0, count, g0 == split_vb0, MODE == FCCE_MODE_FWD_FUSED,
                    sm, sgid, lane);
    }
  }
  if (MODE != FCCE_MODE_DH && ec == 0 && t.ok) {
    part_max[at] = run_max;
    part_sum[at] = run_sum;
    if (kEnt) {
      ent_parts.r[at] = ent.r;
      ent_parts.lsum[at] = ent.lsum;
      ent_parts.arg[at] = ent.arg;
    }
  }
}

} // namespace fcce
