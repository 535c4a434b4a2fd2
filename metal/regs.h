// The dh pass and the fused forward with their accumulator in registers (the
// plan's kernels for both; plan.cpp, acc_in_registers). A threadgroup owns BM
// rows of h and one round of a split's blocks (as in head_tiles), and walks H
// in chunks of FCCE_REG_PIECES BK-wide column pieces (FCCE_REG_COLS columns).
// For the first chunk it computes each block's logits over all of H and its
// coefficient tile (as head_tiles does: dS for DH; exp(s - max) dcap for
// FWD_FUSED, with the row statistics and the factor exp(old max - new max)
// that rescales the accumulator). With more than one chunk it keeps each
// block's coefficients (and factors) in `stage` (FCCE_STAGE_FLOATS per block;
// each thread reads back only what it wrote), so the logits are computed once.
// Per chunk and block it adds the coefficients [BM, BN] times W's rows
// [BN, piece] into each piece's accumulator, the W piece staged through
// threadgroup memory. The accumulators stay in registers over the round's
// blocks, so each chunk of the split's [BM, H] partial is written once per
// launch (and read once when the launch resumes a split): no
// read-modify-write per group of blocks. Per thread: FCCE_REG_PIECES tiles of
// 2 x 2 fragments (8 floats): 64 floats.
#pragma once

namespace fcce {

using RegTile = decltype(AccMMA<float>::Ctile); // the same float fragments for every T

// The register accumulators of the chunk of H at column c0, one per BK-wide
// piece: loaded from the float32 [rows, H] block `part` where the launch
// resumes it (its predecessor wrote it), else cleared.
template <class MMA>
METAL_FUNC void start_chunk(thread RegTile* acc, thread const MMA& mma, const device float* part,
                            int H, int c0, short rows, bool resume) {
  for (short j = 0; j < FCCE_REG_PIECES; ++j) {
    // Columns of piece j inside H (<= 0 past its end).
    const short2 dims(short(min(FCCE_BK, H - c0 - j * FCCE_BK)), rows);
    if (resume && dims.x > 0) {
      acc[j].template load_safe<float, FCCE_WM, FCCE_WN>(
          part + c0 + j * FCCE_BK + mma.sm * H + mma.sn, H, dims - short2(mma.sn, mma.sm));
    } else {
      acc[j].clear();
    }
  }
}

// The chunk's accumulators stored into `part`, the pieces inside H.
template <class MMA>
METAL_FUNC void store_chunk(thread const RegTile* acc, thread MMA& mma, device float* part, int H,
                            int c0, short rows) {
  for (short j = 0; j < FCCE_REG_PIECES; ++j) {
    const int i0 = c0 + j * FCCE_BK;
    if (i0 < H) {
      mma.Ctile = acc[j];
      mma.store_result_safe(part + i0, H, short2(short(min(FCCE_BK, H - i0)), rows));
    }
  }
}

// kEnt (DH only): dS takes the entropy's share too (write_ds8), from `ent`.
template <int MODE, bool kEnt = false, typename HT, class W>
METAL_FUNC void regs_tiles(
    const device HT* h, thread const W& w, const device int* targets,
    const device float* lse, const device float* g, const device float* g_lse,
    device float* part_max, device float* part_sum, device float* target_logit,
    device float* part_acc, device float* stage_buf, const constant FcceParams& p,
    threadgroup float* smem, uint3 group, uint3 groups, uint tid, uint sgid, uint lane,
    EntGrad ent = EntGrad{nullptr, nullptr}) {
  constexpr bool kFused = MODE == FCCE_MODE_FWD_FUSED;
  using T = typename W::Tile;
  const HeadSmem<T> sm(smem);
  const HeadRound rd(p, group);
  const int m0 = rd.m0, vb0 = rd.vb0, vb1 = rd.vb1;
  const int er = int(tid) / 4, ec = int(tid % 4) * 8, m = m0 + er;
  const RowTarget t = row_target(p, targets, m);
  const RowGrad r = kFused ? RowGrad{} : row_grad(t, lse, g, g_lse, m, ent);
  float run_max = kFloorLogit, run_sum = 0.0f;
  RowEnt no_ent{0.0f, 0.0f, kNoArg}; // the fused forward keeps no entropy statistics
  if (kFused && p.block_begin > 0 && t.ok) {
    run_max = part_max[rd.split * p.M + m];
    run_sum = part_sum[rd.split * p.M + m];
  }
  device float* part = part_acc + (size_t(rd.split) * size_t(p.M) + size_t(m0)) * size_t(p.H);
  const short rows = short(min(FCCE_BM, p.M - m0));
  const bool staged = p.H > FCCE_REG_COLS;
  // This threadgroup's staged blocks (block_count of them): per block the
  // coefficient tile [BM, BN], then (fused) the row factors [BM].
  device float* stage = stage_buf +
      (size_t(group.y) * groups.x + group.x) * size_t(p.block_count) * FCCE_STAGE_FLOATS;
  threadgroup float* crow = sm.cs + er * kLdC + ec;
  threadgroup float* factor = sm.cs + kTileC; // [BM], after the one coefficient tile

  AccMMA<T> mma(sgid, lane);
  RegTile acc[FCCE_REG_PIECES];
  for (int c0 = 0; c0 < p.H; c0 += FCCE_REG_COLS) {
    start_chunk(acc, mma, part, p.H, c0, rows, p.block_begin > 0);

    for (int vb = vb0; vb < vb1; ++vb) {
      const int v0 = vb * FCCE_BN;
      device float* st = stage + (vb - vb0) * FCCE_STAGE_FLOATS;
      if (c0 == 0) {
        logits_tile(h, w, p, m0, v0, sm.cs, sm, sgid, lane);
        float s[8], dcap[8];
        read_logits8(crow, s, dcap, p.softcap);
        if (kFused) {
          const float f = online_row8<true>(crow, s, dcap, v0 + ec, p, t, target_logit, m,
                                            run_max, run_sum, no_ent);
          if (ec == 0) {
            factor[er] = f;
            if (staged) {
              st[FCCE_BM * FCCE_BN + er] = f;
            }
          }
        } else {
          write_ds8<kEnt>(crow, s, dcap, v0 + ec, p, t, r);
        }
        if (staged) {
          for (int k = 0; k < 8; ++k) {
            st[er * FCCE_BN + ec + k] = crow[k];
          }
        }
      } else {
        // The previous block's pieces have read the tile and the factors.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int k = 0; k < 8; ++k) {
          crow[k] = st[er * FCCE_BN + ec + k];
        }
        if (kFused && ec == 0) {
          factor[er] = st[FCCE_BM * FCCE_BN + er];
        }
      }
      for (short j = 0; j < FCCE_REG_PIECES; ++j) {
        const int i0 = c0 + j * FCCE_BK;
        if (i0 < p.H) { // the same for every thread of the threadgroup
          threadgroup_barrier(mem_flags::mem_threadgroup);
          w.load(p, v0, i0, sm.ws, sgid, lane);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          mma.Ctile = acc[j];
          if (kFused) {
            // The earlier blocks' sum to this block's row maximum.
            for (short a = 0; a < RegTile::kTileRows; ++a) {
              const float f = factor[mma.sm + a * 8 * FCCE_WM];
              for (short b = 0; b < RegTile::kTileCols; ++b) {
                mma.Ctile.frag_at(a, b) *= f;
              }
            }
          }
          mma_mixed<FCCE_BN>(mma, sm.cs, sm.ws);
          acc[j] = mma.Ctile;
        }
      }
    }
    store_chunk(acc, mma, part, p.H, c0, rows);
  }
  if (kFused && ec == 0 && t.ok) {
    part_max[rd.split * p.M + m] = run_max;
    part_sum[rd.split * p.M + m] = run_sum;
  }
}

} // namespace fcce
