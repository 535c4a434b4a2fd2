// dW of a dense head (dw_tiles: the grouped kernel, for
// Problem::acc_registers = -1; dw_regs_tiles below: the plan's). A threadgroup owns BN vocabulary rows (of the launch's
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

// A dW threadgroup's part of the launch: its BN rows of the slab (from r0,
// vocabulary rows from v0; `rows` of them inside the slab) and the launch's
// m tiles [m_tile_begin, mt_end).
struct DwRows {
  int r0, v0;
  short rows;
  int mt_end;

  METAL_FUNC DwRows(const constant FcceParams& p, uint3 group)
      : r0(int(group.x) * FCCE_BN),
        v0(p.v_begin + r0),
        rows(short(min(FCCE_BN, p.v_count - r0))),
        mt_end(min((p.M + FCCE_BM - 1) / FCCE_BM, p.m_tile_begin + p.m_tile_count)) {}
};

template <typename HT, class W>
METAL_FUNC void dw_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* acc, const constant FcceParams& p, threadgroup float* smem,
    uint3 group, uint tid, uint sgid, uint lane) {
  using T = typename W::Tile;
  const HeadSmem<T> sm(smem);
  const DwRows rw(p, group);
  const int v0 = rw.v0, mt_end = rw.mt_end;
  const short out_rows = rw.rows;
  device float* out = acc + size_t(p.acc_row0 + rw.r0) * size_t(p.H);
  const int er = int(tid) / 4, ec = int(tid % 4) * 8;
  // This launch's m tiles, in groups of FCCE_GROUP_BLOCKS whose dS tiles stay
  // in threadgroup memory, so that the float32 rows are read and written once
  // per group; later launches add to the rows the first wrote.

  for (int g0 = p.m_tile_begin; g0 < mt_end; g0 += FCCE_GROUP_BLOCKS) {
    const int count = min(FCCE_GROUP_BLOCKS, mt_end - g0);
    for (int b = 0; b < count; ++b) {
      const int m0 = (g0 + b) * FCCE_BM;
      const RowTarget t = row_target(p, targets, m0 + er);
      const RowGrad r = row_grad(t, lse, g, g_lse, m0 + er);
      threadgroup float* cs = sm.cs + b * kTileC;
      logits_tile(h, w, p, m0, v0, cs, sm, sgid, lane);
      threadgroup float* crow = cs + er * kLdC + ec;
      float s[8], dcap[8];
      read_logits8(crow, s, dcap, p.softcap);
      write_ds8(crow, s, dcap, v0 + ec, p, t, r);
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


// dW with its accumulator in registers (the plan's kernel; the grouped
// dw_tiles above remain for Problem::acc_registers = -1). A threadgroup owns
// BN vocabulary rows and walks the launch's m tiles, H in chunks of
// FCCE_REG_PIECES BK-wide pieces, as regs.h walks vocabulary blocks for dh:
// for the first chunk it computes each m tile's logits over all of H and its
// dS tile (staged in device memory, FCCE_BM * FCCE_BN floats per m tile, where
// H takes more than one chunk, each thread reading back only what it wrote);
// per chunk and m tile it adds dS^T times the m tile's h piece into the
// piece's accumulator, which stays in registers over the launch's m tiles.
// The float32 [BN, H] rows are written once per launch, and read once by a
// launch that continues them (m_tile_begin > 0): no read-modify-write per
// group of m tiles.
// kEnt: dS takes the entropy's share too (write_ds8), from `ent`.
template <bool kEnt = false, typename HT, class W>
METAL_FUNC void dw_regs_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* acc_rows, device float* stage_buf, const constant FcceParams& p,
    threadgroup float* smem, uint3 group, uint tid, uint sgid, uint lane,
    EntGrad ent = EntGrad{nullptr, nullptr}) {
  using T = typename W::Tile;
  const HeadSmem<T> sm(smem);
  const DwRows rw(p, group);
  const int v0 = rw.v0, mt_end = rw.mt_end;
  device float* out = acc_rows + size_t(p.acc_row0 + rw.r0) * size_t(p.H);
  const int er = int(tid) / 4, ec = int(tid % 4) * 8;
  const bool staged = p.H > FCCE_REG_COLS;
  device float* stage =
      stage_buf + size_t(group.x) * size_t(p.m_tile_count) * (FCCE_BM * FCCE_BN);
  threadgroup float* ds_row = sm.cs + er * kLdC + ec;

  DwMMA<T> mma(sgid, lane);
  RegTile rows_sum[FCCE_REG_PIECES];
  for (int c0 = 0; c0 < p.H; c0 += FCCE_REG_COLS) {
    start_chunk(rows_sum, mma, out, p.H, c0, rw.rows, p.m_tile_begin > 0);

    for (int mt = p.m_tile_begin; mt < mt_end; ++mt) {
      const int m0 = mt * FCCE_BM;
      device float* ds_stage = stage + (mt - p.m_tile_begin) * (FCCE_BM * FCCE_BN);
      if (c0 == 0) {
        const RowTarget t = row_target(p, targets, m0 + er);
        const RowGrad r = row_grad(t, lse, g, g_lse, m0 + er, ent);
        logits_tile(h, w, p, m0, v0, sm.cs, sm, sgid, lane);
        float s[8], dcap[8];
        read_logits8(ds_row, s, dcap, p.softcap);
        write_ds8<kEnt>(ds_row, s, dcap, v0 + ec, p, t, r);
        if (staged) {
          for (int k = 0; k < 8; ++k) {
            ds_stage[er * FCCE_BN + ec + k] = ds_row[k];
          }
        }
      } else {
        // The previous m tile's pieces have read the dS tile.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int k = 0; k < 8; ++k) {
          ds_row[k] = ds_stage[er * FCCE_BN + ec + k];
        }
      }
      for (short j = 0; j < FCCE_REG_PIECES; ++j) {
        const int i0 = c0 + j * FCCE_BK;
        if (i0 < p.H) { // the same for every thread of the threadgroup
          threadgroup_barrier(mem_flags::mem_threadgroup);
          DenseTile<HT, T>::load(h, p.M, p.H, m0, i0, sm.hs, sgid, lane);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          mma.Ctile = rows_sum[j];
          mma_mixed<FCCE_BM>(mma, sm.cs, sm.hs);
          rows_sum[j] = mma.Ctile;
        }
      }
    }
    store_chunk(rows_sum, mma, out, p.H, c0, rw.rows);
  }
}

} // namespace fcce
