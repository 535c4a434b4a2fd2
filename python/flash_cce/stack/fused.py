"""Fused elementwise kernels of a training step on NVIDIA GPUs.

Composed of MLX ops, the elementwise steps below are chains of kernels, each a
pass over a `[tokens, hidden]` or float32 `[B, heads, block, keys]` array; and
`mx.compile`, which would fuse them, leaves functions unfused under a gradient
transformation (their inputs are tracers). Here each is one kernel,
JIT-compiled by MLX (`mx.fast.cuda_kernel`); callers use them when
`available()` and MLX's ops otherwise.

Blocked attention (`attention`), one block's:
- `softmax(s, ...)`: `(p, lse)` with `lse = logsumexp(masked s)` per row and
  `p = exp(masked s - lse)`;
- `score_grads(s, dp, lse, delta, ...)`: `(p, ds)` with `ds = p * (dp - delta)`;
both a warp per row, reading 16 bytes a lane where the row length allows and
keeping a running maximum and sum, so a row is read twice rather than three times.
The mask is made from positions: query row `r` sits at `q_start + r % n` (n
queries per block) and key column `c` at `k_start + c`; a key is visible when
(not causal or key <= query) and (no window or query - key < window). Masked
scores count as `-3e38`, as in the composed path, so the arithmetic is the same
up to the order of the row sums.

Gemma's MLP (`layers`): `gelu_approx_grad(x, g)`, the gradient of
`nn.gelu_approx` at x times g, one thread per entry (MLX differentiates the
compiled forward op by op: about ten passes).
"""


import mlx.core as mx

NEG = -3.0e38

_HEADER = """
__device__ inline bool fcce_visible(int q, int k, bool causal, int window) {
  return k >= 0 && (!causal || k <= q) && (window <= 0 || q - k < window);
}

// N values of a row from column c: one 16-byte load when they are 16 bytes.
template <int N, typename T>
__device__ inline void fcce_load(const T* x, int c, float* out) {
  if (N * sizeof(T) == 16) {
    uint4 u = *reinterpret_cast<const uint4*>(x + c);
    const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = (float)t[j];
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = (float)x[c + j];
  }
}

// N values to column c, in 8-byte pieces where they fill them.
template <int N, typename P>
__device__ inline void fcce_store(P* y, int c, const float* v) {
  if (N * sizeof(P) % 8 == 0) {
    alignas(16) P o[N];
#pragma unroll
    for (int j = 0; j < N; ++j) o[j] = (P)v[j];
#pragma unroll
    for (int j = 0; j < (int)(N * sizeof(P) / 8); ++j)
      reinterpret_cast<uint2*>(y + c)[j] = reinterpret_cast<const uint2*>(o)[j];
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) y[c + j] = (P)v[j];
  }
}

// The masked score: NEG_SCORE where the key is not visible.
template <int N, bool CAUSAL, int WINDOW>
__device__ inline void fcce_mask(float* v, int q, int k) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = fcce_visible(q, k + j, CAUSAL, WINDOW) ? v[j] : NEG_SCORE;
}

// A warp's row: each lane keeps a running (max, sum) over its values (one
// exponential a value), the warp merges them, a second read writes p.
template <int N, bool CAUSAL, int WINDOW, typename T, typename P>
__device__ void fcce_softmax_row(const T* x, P* y, float* lse, int n, int q, int k0, int lane) {
  float m = -INFINITY, sum = 0.0f, v[N];
#pragma unroll 2
  for (int c = lane * N; c < n; c += 32 * N) {
    fcce_load<N>(x, c, v);
    fcce_mask<N, CAUSAL, WINDOW>(v, q, k0 + c);
    float top = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) top = fmaxf(top, v[j]);
    if (top > m) {
      sum *= expf(m - top);
      m = top;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) sum += expf(v[j] - m);
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, sum, o);
    const float top = fmaxf(m, m2);
    // Lanes without values hold (-inf, 0): weigh them by 1, not exp(nan).
    sum = (m == top ? sum : sum * expf(m - top)) + (m2 == top ? s2 : s2 * expf(m2 - top));
    m = top;
  }
  const float l = m + logf(sum);
  if (lane == 0) *lse = l;
#pragma unroll 2
  for (int c = lane * N; c < n; c += 32 * N) {
    fcce_load<N>(x, c, v);
    fcce_mask<N, CAUSAL, WINDOW>(v, q, k0 + c);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = expf(v[j] - l);
    fcce_store<N>(y, c, v);
  }
}

template <int N, bool CAUSAL, int WINDOW, typename T>
__device__ void fcce_score_grads_row(const T* s, const T* dp, T* p, T* ds, float l, float d,
                                     int n, int q, int k0, int lane) {
  float sv[N], dv[N];
#pragma unroll 2
  for (int c = lane * N; c < n; c += 32 * N) {
    fcce_load<N>(s, c, sv);
    fcce_load<N>(dp, c, dv);
    fcce_mask<N, CAUSAL, WINDOW>(sv, q, k0 + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      sv[j] = expf(sv[j] - l);
      dv[j] = sv[j] * (dv[j] - d);
    }
    fcce_store<N>(p, c, sv);
    fcce_store<N>(ds, c, dv);
  }
}
"""

# Both: a warp a row; 16-byte loads where the row length is a multiple of them.
_ROW = """
  const int n_keys = s_shape[s_ndim - 1];
  const int n_queries = geom[2] > 0 ? geom[2] : s_shape[s_ndim - 2];
  long rows = 1;
  for (int i = 0; i < s_ndim - 1; ++i) rows *= s_shape[i];
  const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  // Batched blocks (geom[4] of them, geom[3] rows each): block j's queries and
  // keys start geom[5] j positions later. Keys before position geom[7 + b] of
  // batch row b (geom[6] rows each) are masked: positions count from there.
  const int j = geom[4] > 1 ? (int)((row / geom[3]) % geom[4]) : 0;
  const int first = geom[6] > 0 ? geom[7 + (int)(row / geom[6])] : 0;
  const int q = geom[0] + (int)(row % n_queries) + j * geom[5] - first;
  const int k0 = geom[1] + j * geom[5] - first;
  const long at = row * n_keys;
  constexpr int W = 16 / sizeof(T);
"""

_SOFTMAX = _ROW + """
  if (n_keys % W == 0)
    fcce_softmax_row<W, CAUSAL, WINDOW>(s + at, p + at, lse + row, n_keys, q, k0, lane);
  else
    fcce_softmax_row<1, CAUSAL, WINDOW>(s + at, p + at, lse + row, n_keys, q, k0, lane);
"""

_SCORE_GRADS = _ROW + """
  const float l = lse[row], d = delta[row];
  if (n_keys % W == 0)
    fcce_score_grads_row<W, CAUSAL, WINDOW>(s + at, dp + at, p + at, ds + at, l, d, n_keys, q, k0, lane);
  else
    fcce_score_grads_row<1, CAUSAL, WINDOW>(s + at, dp + at, p + at, ds + at, l, d, n_keys, q, k0, lane);
"""

_GELU_GRAD = """
  long total = 1;
  for (int i = 0; i < x_ndim; ++i) total *= x_shape[i];
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  const float v = (float)x[i];
  const float t = tanhf(c * (v + 0.044715f * v * v * v));
  const float d = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * v * v);
  dx[i] = (T)((float)g[i] * d);
"""

_kernels = {}


def _kernel(name, inputs, outputs, source):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=name, input_names=inputs, output_names=outputs,
            source=source, header=_HEADER.replace("NEG_SCORE", f"({NEG:.1e}f)"),
        )
    return _kernels[name]


def available():
    """Whether the kernels run here: MLX's CUDA backend is the default device."""
    return (
        mx.default_device() == mx.gpu
        and hasattr(mx, "cuda") and mx.cuda.is_available()
        and hasattr(mx.fast, "cuda_kernel")
    )


_ROWS_PER_BLOCK = 4  # a warp a row


def _warps(rows):
    """Threads of a launch with a warp per row (MLX's grid counts threads)."""
    return -(-rows // _ROWS_PER_BLOCK) * _ROWS_PER_BLOCK * 32


def _template(causal, window, **dtypes):
    return [("CAUSAL", bool(causal)), ("WINDOW", int(window or 0))] + list(dtypes.items())


def _geometry(s, q_start, k_start, blocks, key_start):
    # [first query, first key, queries a block, rows a block, blocks, step,
    #  rows a batch row, first key of each batch row]
    n, rows, count, step = blocks or (0, 1, 1, 0)
    starts = list(key_start or [])
    if starts and len(starts) != s.shape[0]:
        raise ValueError(f"key_start: {len(starts)} values for {s.shape[0]} batch rows")
    per_batch = s.size // (s.shape[-1] * s.shape[0]) if starts else 0
    return mx.array([q_start, k_start, n, rows, count, step, per_batch] + starts, mx.int32)


def softmax(s, q_start, k_start, causal, window, dtype, blocks=None, key_start=None):
    """`(p, lse)` of raw block scores `s` `[..., n, K]` (row-contiguous): p in
    `dtype`, lse float32 `[..., n, 1]`. Row r's query sits at `q_start + r % n`,
    column c's key at `k_start + c`. `blocks = (n, rows, count, step)`: the rows
    are `count` batched blocks of `rows` rows (n queries each), cycling, and block
    j's queries and keys sit `j * step` positions later. `key_start` (one int per
    `s.shape[0]`) masks each batch row's keys before that position."""
    rows = s.size // s.shape[-1]
    p, lse = _kernel("fcce_attn_softmax", ["s", "geom"], ["p", "lse"], _SOFTMAX)(
        inputs=[s, _geometry(s, q_start, k_start, blocks, key_start)],
        template=_template(causal, window, T=s.dtype, P=dtype),
        grid=(_warps(rows), 1, 1), threadgroup=(_ROWS_PER_BLOCK * 32, 1, 1),
        output_shapes=[s.shape, s.shape[:-1] + (1,)], output_dtypes=[dtype, mx.float32],
    )
    return p, lse


def score_grads(s, dp, lse, delta, q_start, k_start, causal, window, blocks=None,
                key_start=None):
    """`(p, ds)` in `s.dtype` of a block: raw scores `s` and `dp = dO V^T`
    `[..., n, K]`, its rows' `lse` and `delta = sum(dO * O)` `[..., n, 1]`
    (positions, `blocks` and `key_start` as in `softmax`)."""
    p, ds = _kernel(
        "fcce_attn_score_grads", ["s", "dp", "lse", "delta", "geom"], ["p", "ds"], _SCORE_GRADS,
    )(
        inputs=[s, dp, lse.astype(mx.float32), delta.astype(mx.float32),
                _geometry(s, q_start, k_start, blocks, key_start)],
        template=_template(causal, window, T=s.dtype),
        grid=(_warps(s.size // s.shape[-1]), 1, 1), threadgroup=(_ROWS_PER_BLOCK * 32, 1, 1),
        output_shapes=[s.shape, s.shape], output_dtypes=[s.dtype, s.dtype],
    )
    return p, ds


def gelu_approx_grad(x, g):
    """`g * d/dx nn.gelu_approx(x)` in `g.dtype` (x and g of one shape)."""
    (dx,) = _kernel("fcce_gelu_approx_grad", ["x", "g"], ["dx"], _GELU_GRAD)(
        inputs=[x, g], template=[("T", g.dtype)],
        grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[x.shape], output_dtypes=[g.dtype],
    )
    return dx
