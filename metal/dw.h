// dW of a dense head. A threadgroup owns BN vocabulary rows (of the launch's
// slab [v_begin, v_begin + v_count)) and walks the launch's BM-row tiles of h
// ([m_tile_begin, + m_tile_count); the plan bounds them): per tile
// it recomputes the logits and forms dS as the dh pass does; per group of
// FCCE_GROUP_BLOCKS tiles it adds the sum of dS^T [BN, BM] h [BM, H] into its
// float32 rows of `acc` (dw itself for a float32 head, else the slab's
// staging buffer), H in BK-wide pieces. No other
// threadgroup touches those rows, so the read-modify-write needs no atomics.
#pragma once

namespace fcce {

// dS^T [BN, BM] (the float coefficient tile read transposed) times an h tile
// [BM, BK] of T, through mma_mixed.
template <typename T>
using DwMMA = mlx::steel::BlockMMA<
    float, float, FCCE_BN, FCCE_BK, FCCE_BM, FCCE_WM, FCCE_WN,
    true, false, kLdC, FCCE_TILE_LD(sizeof(T))>;

// kEnt: dS takes the entropy's share too (write_ds8), from `ent`.
template <bool kEnt = false, typename HT, class W>
METAL_FUNC void dw_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* acc, const constant FcceParams& p, threadgroup float* smem,
    uint3 group, uint tid, uint sgid, uint lane, EntGrad ent = EntGrad{nullptr, nullptr}) {
  using T = typename W::Tile;
  const HeadSmem<T> sm(smem);
  const int r0 = int(group.x) * FCCE_BN; // first row within the slab
  const int v0 = p.v_begin + r0;
  const short out_rows = short(min(FCCE_BN, p.v_count - r0));
  device float* out = acc + size_t(p.acc_row0 + r0) * size_t(p.H);
  const int er = int(tid) / 4, ec = int(tid % 4) * 8;
  // This launch's m tiles, in groups of FCCE_GROUP_BLOCKS whose dS tiles stay
  // in threadgroup memory, so that the float32 rows are read and written once
  // per group; later launches add to the rows the first wrote.
  const int mt_end = min((p.M + FCCE_BM - 1) / FCCE_BM, p.m_tile_begin + p.m_tile_count);

  for (int g0 = p.m_tile_begin; g0 < mt_end; g0 += FCCE_GROUP_BLOCKS) {
    const int count = min(FCCE_GROUP_BLOCKS, mt_end - g0);
    for (int b = 0; b < count; ++b) {
      const int m0 = (g0 + b) * FCCE_BM;
      const RowTarget t = row_target(p, targets, m0 + er);
      const RowGrad r = row_grad(t, lse, g, g_lse, m0 + er, ent);
      threadgroup float* cs = sm.cs + b * kTileC;
      logits_tile(h, w, p, m0, v0, cs, sm, sgid, lane);
      threadgroup float* crow = cs + er * kLdC + ec;
      float s[8], dcap[8];
      read_logits8(crow, s, dcap, p.softcap);
      write_ds8<kEnt>(crow, s, dcap, v0 + ec, p, t, r);
    }

    for (int i0 = 0; i0 < p.H; i0 += FCCE_BK) {
      DwMMA<T> mma(sgid, lane);
      const short2 dims(short(min(FCCE_BK, p.H - i0)), out_rows);
      device float* dst = out + i0;
      for (int b = 0; b < count; ++b) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        DenseTile<HT, T>::load(h, p.M, p.H, (g0 + b) * FCCE_BM, i0, sm.hs, sgid, lane);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (b == 0 && g0 > 0) {
          mma.Ctile.template load_safe<float, FCCE_WM, FCCE_WN>(
              dst + mma.sm * p.H + mma.sn, p.H, dims - short2(mma.sn, mma.sm));
        }
        mma_mixed<FCCE_BM>(mma, sm.cs + b * kTileC, sm.hs);
      }
      mma.store_result_safe(dst, p.H, dims);
    }
  }
}

} // namespace fcce
