// dh with its accumulator in registers (the plan's dh kernel; plan.cpp,
// dh_in_registers). A threadgroup owns BM rows of h and one round of a split's
// blocks (as in head_tiles), and walks H in chunks of FCCE_REG_PIECES
// BK-wide column pieces (FCCE_REG_COLS columns). For the first chunk it
// computes each block's logits over all of H and dS (as the DH mode of
// head_tiles does); with more than one chunk it keeps each block's dS tile
// in `ds_stage` (4 KB per block, the thread's own 8 entries, read back by the
// same thread for the later chunks), so the logits are computed once. Per
// chunk and block it adds dS [BM, BN] times W's rows [BN, piece] into each
// piece's accumulator, the W piece staged through threadgroup memory. The
// accumulators stay in registers over the round's blocks, so each chunk of
// the split's [BM, H] partial is written once per launch (and read once when
// the launch resumes a split): no read-modify-write per group of blocks.
// Per thread: FCCE_REG_PIECES tiles of 2 x 2 fragments (8 floats): 64 floats.
#pragma once

namespace fcce {

using RegTile = decltype(AccMMA::Ctile);

template <typename HT, class W>
METAL_FUNC void dh_regs_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* part_acc, device float* ds_stage, const constant FcceParams& p,
    threadgroup float* smem, uint3 group, uint3 groups, uint tid, uint sgid, uint lane) {
  const HeadSmem sm(smem);
  const HeadRound rd(p, group);
  const int m0 = rd.m0, vb0 = rd.vb0, vb1 = rd.vb1;
  const int er = int(tid) / 4, ec = int(tid % 4) * 8, m = m0 + er;
  const RowTarget t = row_target(p, targets, m);
  const RowGrad r = row_grad(t, lse, g, g_lse, m);
  device float* part = part_acc + (size_t(rd.split) * size_t(p.M) + size_t(m0)) * size_t(p.H);
  const short rows = short(min(FCCE_BM, p.M - m0));
  const int chunks = (p.H + FCCE_REG_COLS - 1) / FCCE_REG_COLS;
  // This threadgroup's dS tiles (block_count of them) and the thread's 8 entries.
  device float* stage = ds_stage +
      (size_t(group.y) * groups.x + group.x) * size_t(p.block_count) * (FCCE_BM * FCCE_BN) +
      er * FCCE_BN + ec;
  threadgroup float* crow = sm.cs + er * kLdC + ec;

  AccMMA mma(sgid, lane);
  RegTile acc[FCCE_REG_PIECES];
  for (int c0 = 0; c0 < p.H; c0 += FCCE_REG_COLS) {
    for (short j = 0; j < FCCE_REG_PIECES; ++j) {
      // Columns of piece j inside H (<= 0 past its end).
      const short2 dims(short(min(FCCE_BK, p.H - c0 - j * FCCE_BK)), rows);
      if (p.block_begin > 0 && dims.x > 0) {
        acc[j].template load_safe<float, FCCE_WM, FCCE_WN>(
            part + c0 + j * FCCE_BK + mma.sm * p.H + mma.sn, p.H, dims - short2(mma.sn, mma.sm));
      } else {
        acc[j].clear();
      }
    }

    for (int vb = vb0; vb < vb1; ++vb) {
      const int v0 = vb * FCCE_BN;
      device float* ds = stage + (vb - vb0) * (FCCE_BM * FCCE_BN);
      if (c0 == 0) {
        logits_tile(h, w, p, m0, v0, sm.cs, sm, tid, sgid, lane);
        float s[8], dcap[8];
        read_logits8(crow, s, dcap, p.softcap);
        write_ds8(crow, s, dcap, v0 + ec, p, t, r);
        if (chunks > 1) {
          for (int k = 0; k < 8; ++k) {
            ds[k] = crow[k];
          }
        }
      } else {
        // The previous block's pieces have read the tile.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int k = 0; k < 8; ++k) {
          crow[k] = ds[k];
        }
      }
      for (short j = 0; j < FCCE_REG_PIECES; ++j) {
        const int i0 = c0 + j * FCCE_BK;
        if (i0 < p.H) { // the same for every thread of the threadgroup
          threadgroup_barrier(mem_flags::mem_threadgroup);
          w.load(p, v0, i0, sm.ws, tid);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          mma.Ctile = acc[j];
          mma.mma(sm.cs, sm.ws);
          acc[j] = mma.Ctile;
        }
      }
    }

    for (short j = 0; j < FCCE_REG_PIECES; ++j) {
      const int i0 = c0 + j * FCCE_BK;
      if (i0 < p.H) {
        mma.Ctile = acc[j];
        mma.store_result_safe(part + i0, p.H, short2(short(min(FCCE_BK, p.H - i0)), rows));
      }
    }
  }
}

} // namespace fcce
