// The element-wise passes: merging the splits' row statistics into lse and
// logp, summing the splits' [M, H] partials, casting staged dW rows, and the
// fused backward's dh = g dcap_y W_y + (g_lse - g) gsum.
#pragma once

namespace fcce {

// The forward's entropy statistics per row (combine_row with kEnt): the
// entropy of the softmax, whether the target is the first arg-max, the mean
// logit.
struct EntOut {
  device float* entropy;
  device bool* is_top1;
  device float* mean_logit;
};

// lse = log sum_s part_sum[s] exp(part_max[s]); logp = s_y - lse (0 for
// ignored rows, NaN for targets outside [0, V)). kEnt also merges the
// splits' entropy statistics (head.h's RowEnt) as the sums merge: each split's
// r moved to the global maximum, exp(m_s - gmax) (r_s + (m_s - gmax) sum_s);
// entropy = log total - r / total; the first arg-max is the smallest among
// the splits at the global maximum.
template <bool kEnt = false>
METAL_FUNC void combine_row(
    const device int* targets, const device float* part_max, const device float* part_sum,
    const device float* target_logit, device float* logp, device float* lse,
    const constant FcceParams& p, uint m, EntParts parts = EntParts{},
    EntOut out = EntOut{}) {
  if (int(m) >= p.M) {
    return;
  }
  float gmax = kFloorLogit;
  for (int s = 0; s < p.splits; ++s) {
    gmax = max(gmax, part_max[s * p.M + m]);
  }
  float total = 0.0f, r = 0.0f, lsum = 0.0f;
  int arg = kNoArg;
  for (int s = 0; s < p.splits; ++s) {
    const int at = s * p.M + int(m);
    const float f = metal::precise::exp(part_max[at] - gmax);
    total += part_sum[at] * f;
    if (kEnt) {
      r += f * (parts.r[at] + (part_max[at] - gmax) * part_sum[at]);
      lsum += parts.lsum[at];
      arg = part_max[at] == gmax ? min(arg, parts.arg[at]) : arg;
    }
  }
  const float l = gmax + metal::precise::log(total);
  lse[m] = l;
  const int y = targets[m];
  logp[m] = y == p.ignore_index ? 0.0f
      : (y >= 0 && y < p.V) ? target_logit[m] - l
                            : metal::numeric_limits<float>::quiet_NaN();
  if (kEnt) {
    out.entropy[m] = metal::precise::log(total) - r / total;
    out.is_top1[m] = y == arg && y != p.ignore_index;
    out.mean_logit[m] = lsum / float(p.V);
  }
}

// out[i] = sum_s weight_s part_acc[s, i] over the M x H elements, with weight 1
// (dh) or exp(part_max[s, row] - lse[row]) (gsum).
template <int MODE, typename OutT>
METAL_FUNC void reduce_splits(
    const device float* part_acc, const device float* part_max, const device float* lse,
    device OutT* out, const constant FcceParams& p, uint i) {
  if (int(i) >= p.count) {
    return;
  }
  const size_t n = size_t(p.M) * size_t(p.H);
  const int m = int(i) / p.H;
  float acc = 0.0f;
  for (int s = 0; s < p.splits; ++s) {
    const float x = part_acc[size_t(s) * n + i];
    acc += MODE == FCCE_REDUCE_GSUM
        ? x * metal::precise::exp(part_max[s * p.M + m] - lse[m])
        : x;
  }
  out[i] = static_cast<OutT>(acc);
}

template <typename OutT>
METAL_FUNC void cast_rows(
    const device float* src, device OutT* dw, const constant FcceParams& p, uint i) {
  if (int(i) < p.count) {
    dw[size_t(p.v_begin) * size_t(p.H) + i] = static_cast<OutT>(src[i]);
  }
}

// Element i of a scales or biases array of dtype `kind` (FcceParams::sb_dtype:
// 0 float32, 1 float16, 2 bfloat16), read from its raw bytes.
METAL_FUNC float load_scale(const device uint8_t* base, int kind, size_t i) {
  if (kind == 0) {
    return ((const device float*)base)[i];
  }
  const ushort bits = ((const device ushort*)base)[i];
  return kind == 1 ? float(as_type<half>(bits)) : as_type<float>(uint(bits) << 16);
}

// Element i of row v of a dense head.
template <typename T>
struct DenseElement {
  const device T* w;
  METAL_FUNC float at(const constant FcceParams& p, int v, int i) const {
    return float(w[size_t(v) * size_t(p.H) + i]);
  }
};

// Element i of row v of an affine-quantized head: bits [i bits, (i + 1) bits)
// of the row's LSB-first bit stream, which span at most two bytes.
struct QuantElement {
  const device uint8_t* w;
  const device uint8_t* scales;
  const device uint8_t* biases;
  METAL_FUNC float at(const constant FcceParams& p, int v, int i) const {
    const device uint8_t* row = w + size_t(v) * size_t(p.row_bytes);
    const int bit = i * p.bits, byte = bit >> 3;
    uint two = row[byte];
    if (byte + 1 < p.row_bytes) {
      two |= uint(row[byte + 1]) << 8;
    }
    const uint q = (two >> (bit & 7)) & ((1u << p.bits) - 1u);
    const size_t group = size_t(v) * size_t(p.groups) + size_t(i / p.group_size);
    return load_scale(scales, p.sb_dtype, group) * float(q) +
        load_scale(biases, p.sb_dtype, group);
  }
};

template <typename OutT, class E>
METAL_FUNC void fused_dh_element(
    const device float* gsum, thread const E& w, const device int* targets,
    const device float* logp, const device float* lse, const device float* g,
    const device float* g_lse, device OutT* dh, const constant FcceParams& p, uint idx) {
  if (int(idx) >= p.count) {
    return;
  }
  const int m = int(idx) / p.H, i = int(idx) - m * p.H;
  const int y = targets[m];
  const bool ok = y != p.ignore_index && y >= 0 && y < p.V;
  const float gm = ok ? g[m] : 0.0f;
  float coef_y = gm;
  if (ok && p.softcap > 0.0f) {
    const float t = (logp[m] + lse[m]) / p.softcap; // s_y / cap = tanh(raw / cap)
    coef_y *= 1.0f - t * t;
  }
  const float wy = ok ? w.at(p, y, i) : 0.0f;
  dh[idx] = static_cast<OutT>((g_lse[m] - gm) * gsum[idx] + coef_y * wy);
}

} // namespace fcce
