"""The emulated Metal kernels behind flash_cce._ext's interface.

The run-time self-check (flash_cce.selfcheck, called by flash_cce.metal's
gate) takes a `native` object with _ext's forward, backward and
metal_plan_limits. EmuNative is one: each call asks csrc/metal/plan.cpp for
the launches the Metal host would encode (head_emu.plan) and runs them on the
emulated kernels of a build (head_emu.build), so that the gate's own code
checks the Metal kernels, or a planted defect in them, on the CPU.
"""

import mlx.core as mx
import numpy as np

import head_emu as he

DTYPE_NAMES = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}


def to_host(a: mx.array) -> np.ndarray:
    """An MLX array in the storage form head_emu uses (bfloat16 as its bits)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def from_host(x: np.ndarray, dtype: str) -> mx.array:
    a = mx.array(x)
    return a.view(mx.bfloat16) if dtype == "bf16" else a


class EmuNative:
    """forward / backward / metal_plan_limits of flash_cce._ext, run on the
    emulated Metal kernels of `program` (stream arguments are ignored: the
    emulator runs on the CPU)."""

    def __init__(self, program, seed=0):
        self.program, self.seed = program, seed
        self.limits = {"max_splits": 0, "round_blocks": 0}
        self.launches = 0  # kernels run so far
        self.kernels = set()  # their names

    @staticmethod
    def supports_stats(device):
        return True  # the emulated kernels have the entropy variants

    def metal_plan_limits(self, max_splits=0, round_blocks=0, stream=None):
        self.limits = {"max_splits": max_splits, "round_blocks": round_blocks}

    def _plan(self, pass_, h, w, scales, group_size, bits, softcap, ignore_index, **kw):
        (M, H), V = h.shape, w.shape[0]
        kw.update(h=DTYPE_NAMES[h.dtype], softcap=softcap or 0.0, ignore_index=ignore_index,
                  **self.limits)
        if scales is None:
            kw.update(w=DTYPE_NAMES[w.dtype])
        else:
            kw.update(quantized=True, bits=bits, group_size=group_size,
                      sb=DTYPE_NAMES[scales.dtype])
        return he.plan(pass_, M, H, V, **kw)

    def _run(self, plan, arrays):
        self.launches += len(plan["launches"])
        self.kernels |= he.plan_kernels(plan)
        he.run_plan(self.program, plan, arrays, seed=self.seed)
        return arrays

    @staticmethod
    def _operands(h, w, targets, scales, biases):
        a = {"w": np.array(w) if scales is not None else to_host(w),
             "targets": np.array(targets).astype(np.int32)}
        if h is not None:
            a["h"] = to_host(h)
        if scales is not None:
            a.update(scales=to_host(scales), biases=to_host(biases))
        return a

    def _forward(self, h, w, targets, scales, biases, fused, q):
        M, H = h.shape
        a = self._operands(h, w, targets, scales, biases)
        a.update(logp=np.zeros(M, np.float32), lse=np.zeros(M, np.float32),
                 gsum=np.zeros((M, H), np.float32))
        return self._run(self._plan("forward", h, w, scales, fused=fused, **q), a)

    def forward(self, h, w, targets, scales=None, biases=None, *, group_size=64, bits=None,
                softcap=None, ignore_index=-100, fused_backward=False, stream=None, stats=False):
        q = dict(group_size=group_size, bits=bits, softcap=softcap, ignore_index=ignore_index)
        if stats:
            # As the Metal host: the plain forward with the statistics (never fused).
            M = h.shape[0]
            a = self._operands(h, w, targets, scales, biases)
            a.update({k: np.zeros(M, np.float32) for k in ("logp", "lse", "entropy", "mean_logit")})
            a["is_top1"] = np.zeros(M, np.bool_)
            self._run(self._plan("forward", h, w, scales, stats=True, **q), a)
            return [mx.array(a[k]) for k in ("logp", "lse", "entropy", "is_top1", "mean_logit")]
        if not fused_backward:
            a = self._forward(h, w, targets, scales, biases, False, q)
            return [mx.array(a["logp"]), mx.array(a["lse"])]
        # The fused forward keeps gsum; the gradient through it is the fused dh pass.
        state = {}

        @mx.custom_function
        def fused(h_):
            state["a"] = self._forward(h_, w, targets, scales, biases, True, q)
            return mx.array(state["a"]["logp"]), mx.array(state["a"]["lse"])

        @fused.vjp
        def fused_vjp(primals, cotangents, outputs):
            # One primal: MLX passes the array itself.
            h_, (g, g_lse), a = primals, cotangents, state["a"]
            out = DTYPE_NAMES[h_.dtype]
            b = self._operands(None, w, targets, scales, biases)
            b.update(gsum=a["gsum"], logp=a["logp"], lse=a["lse"],
                     g=np.array(g.astype(mx.float32)), g_lse=np.array(g_lse.astype(mx.float32)),
                     dh=np.zeros(h_.shape, he.STORAGE[out]))
            self._run(self._plan("fused_dh", h_, w, scales, out=out, **q), b)
            return (from_host(b["dh"], out),)

        return list(fused(h))

    def backward(self, h, w, targets, lse, g, g_lse=None, scales=None, biases=None, *,
                 group_size=64, bits=None, softcap=None, ignore_index=-100, compute_dw=False,
                 stream=None, entropy=None, g_entropy=None):
        q = dict(group_size=group_size, bits=bits, softcap=softcap, ignore_index=ignore_index)
        dt = DTYPE_NAMES[h.dtype]
        a = self._operands(h, w, targets, scales, biases)
        M = h.shape[0]
        g_lse = mx.zeros((M,), mx.float32) if g_lse is None else g_lse
        a.update(lse=np.array(lse.astype(mx.float32)), g=np.array(g.astype(mx.float32)),
                 g_lse=np.array(g_lse.astype(mx.float32)), dh=np.zeros(h.shape, he.STORAGE[dt]))
        if compute_dw:
            a["dw"] = np.zeros(w.shape, he.STORAGE[DTYPE_NAMES[w.dtype]])
        stats = g_entropy is not None
        if stats:
            a.update(entropy=np.array(entropy.astype(mx.float32)),
                     g_ent=np.array(g_entropy.astype(mx.float32)))
        self._run(self._plan("backward", h, w, scales, compute_dw=compute_dw, stats=stats, **q),
                  a)
        out = [from_host(a["dh"], dt)]
        if compute_dw:
            out.append(from_host(a["dw"], DTYPE_NAMES[w.dtype]))
        return out
