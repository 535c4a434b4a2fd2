"""Fused elementwise kernels of a training step on NVIDIA GPUs.

Composed of MLX ops, the elementwise steps below are chains of kernels, each a
pass over a `[tokens, hidden]` or float32 `[B, heads, block, keys]` array; and
`mx.compile`, which would fuse them, leaves functions unfused under a gradient
transformation (their inputs are tracers). Here each is one kernel,
JIT-compiled by MLX (`mx.fast.cuda_kernel`); callers use them when
`available()` and MLX's ops otherwise.

Blocked attention (`attention`), one block's:
- `softmax(s, ...)`: `(p, lse)` with `lse = logsumexp(masked s)` per row and
  `p = exp(masked s - lse)`, one thread block per row;
- `score_grads(s, dp, lse, delta, ...)`: `(p, ds)` with `ds = p * (dp - delta)`,
  one thread per entry.
The mask is made from positions: query row `r` sits at `q_start + r % n` (n
queries per block) and key column `c` at `k_start + c`; a key is visible when
(not causal or key <= query) and (no window or query - key < window). Masked
scores count as `-3e38`, as in the composed path, so the arithmetic is the same
up to the order of the row sums.

Gemma's MLP (`layers`): `gelu_approx_grad(x, g)`, the gradient of
`nn.gelu_approx` at x times g, one thread per entry (MLX differentiates the
compiled forward op by op: about ten passes).
"""

import os

import mlx.core as mx

NEG = -3.0e38

_HEADER = """
__device__ inline bool fcce_visible(int q, int k, bool causal, int window) {
  return (!causal || k <= q) && (window <= 0 || q - k < window);
}

template <bool MAX>
__device__ inline float fcce_block_reduce(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? fmaxf(v, u) : v + u;
  }
  __syncthreads();  // sh may still be read by the previous reduction
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = MAX ? fmaxf(v, sh[w]) : v + sh[w];
  return v;
}
"""

_SOFTMAX = """
  __shared__ float sh[32];
  const int n_keys = s_shape[s_ndim - 1];
  const int n_queries = s_shape[s_ndim - 2];
  const long row = blockIdx.x;
  const int q = q_start[0] + (int)(row % n_queries);
  const int k0 = k_start[0];
  const T* x = s + row * n_keys;
  float m = -INFINITY;
  for (int c = threadIdx.x; c < n_keys; c += blockDim.x) {
    float v = fcce_visible(q, k0 + c, CAUSAL, WINDOW) ? (float)x[c] : NEG_SCORE;
    m = fmaxf(m, v);
  }
  m = fcce_block_reduce<true>(m, sh);
  float sum = 0.0f;
  for (int c = threadIdx.x; c < n_keys; c += blockDim.x) {
    float v = fcce_visible(q, k0 + c, CAUSAL, WINDOW) ? (float)x[c] : NEG_SCORE;
    sum += expf(v - m);
  }
  sum = fcce_block_reduce<false>(sum, sh);
  const float l = m + logf(sum);
  if (threadIdx.x == 0) lse[row] = l;
  for (int c = threadIdx.x; c < n_keys; c += blockDim.x) {
    float v = fcce_visible(q, k0 + c, CAUSAL, WINDOW) ? (float)x[c] : NEG_SCORE;
    p[row * n_keys + c] = (P)expf(v - l);
  }
"""

_SCORE_GRADS = """
  const int n_keys = s_shape[s_ndim - 1];
  const int n_queries = s_shape[s_ndim - 2];
  long total = n_keys;
  for (int i = 0; i < s_ndim - 1; ++i) total *= s_shape[i];
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long row = i / n_keys;
  const int c = (int)(i % n_keys);
  const int q = q_start[0] + (int)(row % n_queries);
  float v = fcce_visible(q, k_start[0] + c, CAUSAL, WINDOW) ? (float)s[i] : NEG_SCORE;
  float pv = expf(v - lse[row]);
  p[i] = (T)pv;
  ds[i] = (T)(pv * ((float)dp[i] - delta[row]));
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
            source=source.replace("NEG_SCORE", f"({NEG:.1e}f)"), header=_HEADER,
        )
    return _kernels[name]


def available():
    """Whether the kernels run here: MLX's CUDA backend is the default device,
    unless FLASH_CCE_FUSED_KERNELS=0."""
    if os.environ.get("FLASH_CCE_FUSED_KERNELS", "1") == "0":
        return False
    return (
        mx.default_device() == mx.gpu
        and hasattr(mx, "cuda") and mx.cuda.is_available()
        and hasattr(mx.fast, "cuda_kernel")
    )


def _template(causal, window, **dtypes):
    return [("CAUSAL", bool(causal)), ("WINDOW", int(window or 0))] + list(dtypes.items())


def softmax(s, q_start, k_start, causal, window, dtype):
    """`(p, lse)` of raw block scores `s` `[..., n, K]` (row-contiguous): p in
    `dtype`, lse float32 `[..., n, 1]`."""
    rows = s.size // s.shape[-1]
    p, lse = _kernel("fcce_attn_softmax", ["s", "q_start", "k_start"], ["p", "lse"], _SOFTMAX)(
        inputs=[s, mx.array(q_start, mx.int32), mx.array(k_start, mx.int32)],
        template=_template(causal, window, T=s.dtype, P=dtype),
        grid=(rows * 128, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[s.shape, s.shape[:-1] + (1,)], output_dtypes=[dtype, mx.float32],
    )
    return p, lse


def score_grads(s, dp, lse, delta, q_start, k_start, causal, window):
    """`(p, ds)` in `s.dtype` of a block: raw scores `s` and `dp = dO V^T`
    `[..., n, K]`, its rows' `lse` and `delta = sum(dO * O)` `[..., n, 1]`."""
    p, ds = _kernel(
        "fcce_attn_score_grads", ["s", "dp", "lse", "delta", "q_start", "k_start"], ["p", "ds"],
        _SCORE_GRADS,
    )(
        inputs=[s, dp, lse.astype(mx.float32), delta.astype(mx.float32),
                mx.array(q_start, mx.int32), mx.array(k_start, mx.int32)],
        template=_template(causal, window, T=s.dtype),
        grid=(s.size, 1, 1), threadgroup=(256, 1, 1),
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
