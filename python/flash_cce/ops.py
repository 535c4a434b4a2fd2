"""The flash-CCE head ops: validation, backend choice, and the two primitives.

The backend of a call that names none comes from the environment variable
FLASH_CCE_BACKEND ("auto", "native" or "fallback"; unset means "auto").
"""

import os

import mlx.core as mx

from . import _ext, fallback, metal
from .selfcheck import HeadSpec

_BACKENDS = (None, "auto", "native", "fallback")


def _device(stream):
    """The device of a stream, device, device type (mx.cpu) or None (default)."""
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Stream):
        return stream.device
    return mx.Device(stream) if isinstance(stream, mx.DeviceType) else stream


def has_native_kernel(device=None):
    """Whether `device` (default: MLX's default device) has native kernels in
    this build (C++ on the CPU; CUDA or Metal on the GPU). On a Metal GPU they
    still run only where they pass their self-check (flash_cce.metal_status())."""
    return _device(device).type == mx.cpu or _ext.has_gpu_kernels()


def _use_native(backend, stream, spec=None, h=None):
    """Whether a call runs the native kernels. `spec` (a function returning the
    call's HeadSpec, made only where needed) and `h` let "auto" consult the
    Metal gate: on a Metal GPU the kernels run only for configurations that
    passed the self-check, and sizes they index (metal.py)."""
    source = "backend"
    if backend is None:
        backend, source = os.environ.get("FLASH_CCE_BACKEND") or None, "FLASH_CCE_BACKEND"
    if backend not in _BACKENDS:
        raise ValueError(f"{source} must be one of {_BACKENDS[1:]}, got {backend!r}")
    if backend == "fallback":
        return False
    device = _device(stream)
    native = has_native_kernel(device)
    if backend == "native" and not native:
        raise ValueError(f"backend='native' but {device} has no flash-CCE kernel")
    if backend == "native" or not native or spec is None or not metal.gated(device):
        return native
    return metal.fits(h) and metal.GATE.allows(spec())


def _is_tracing_error(err):
    return "transformation" in str(err) or "compile" in str(err)


def check_targets(targets, vocab_size, ignore_index=-100):
    """Raises ValueError for a target outside [0, V) that is not `ignore_index`.

    Needs the values, so it evaluates `targets`; inside `mx.compile` or `mx.vmap`
    that is impossible and the check is skipped: the kernels then return NaN for
    such rows (never a crash or a plausible-looking wrong value).
    """
    bad = ((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index)
    try:
        any_bad = bad.any().item()
    except (RuntimeError, ValueError) as err:
        if _is_tracing_error(err):
            return
        raise
    if any_bad:
        flat = bad.reshape(-1)
        idx = int(mx.argmax(flat).item())
        val = int(targets.reshape(-1)[idx].item())
        raise ValueError(
            f"[flash_cce] targets must lie in [0, {vocab_size}) or equal "
            f"ignore_index={ignore_index}; got {val} at flat index {idx}"
        )


def flash_cce_forward(h, w, targets, scales=None, biases=None, *, group_size=64,
                      bits=None, softcap=None, ignore_index=-100, stream=None,
                      backend=None, validate_targets=True, fused_backward=True,
                      tuning=None):
    """Per-token log-probabilities of a linear head without materialising logits.

    Args:
        h: hidden states `[..., H]` (float32, bfloat16 or float16).
        w: head weight `[V, H]` (dense float), or `mx.quantize`'s packed uint32
            `[V, H * bits / 32]` with `scales` and `biases` `[V, H / group_size]`.
        targets: integer `[...]` (= `h.shape[:-1]`); `ignore_index` rows give 0.
        softcap: Gemma's final logit softcap `cap * tanh(s / cap)`, or None.
        backend: None/"auto" (native kernel where there is one, else the pure-MLX
            fallback), "native" or "fallback".
        fused_backward: let the native forward also accumulate the softmax-weighted
            head rows `sum_v p_v dcap_v W_v` (one `[M, H]` float32 array kept for
            the backward), so that the gradient for `h` costs no second pass over
            the vocabulary: 2 GEMMs for forward + backward instead of 3. Turn it
            off for forward-only use, where it would be wasted work.
        tuning: None, or a dict overriding the native kernels' choices and launch
            sizes, e.g. `{"wgmma": False}` for the portable CUDA kernels or
            `{"row_block": 100, "vocab_chunk": 256}`; keys in docs/cuda.md
            (`_ext.check_tuning()` lists them with their defaults). It is kept
            for the backward; the fallback ignores it.

    Returns:
        `(logp, lse)`, float32 arrays of shape `targets.shape`:
        `logp = s[y] - logsumexp(s)` and `lse = logsumexp(s)`. Differentiable
        in `h` and in a dense `w` (`mx.grad`, `mx.compile`, `mx.vmap`).
    """
    bits = _ext.check_args(h, w, targets, scales, biases, group_size, bits, softcap)
    _ext.check_tuning(tuning)
    if validate_targets:
        check_targets(targets, w.shape[0], ignore_index)
    if _use_native(backend, stream, lambda: HeadSpec.of(h, w, scales, bits, group_size), h):
        logp, lse = _ext.forward(
            h, w, targets, scales, biases, group_size=group_size, bits=bits,
            softcap=softcap, ignore_index=ignore_index, fused_backward=fused_backward,
            tuning=tuning, stream=stream,
        )
        return logp, lse
    lead = targets.shape
    if targets.size == 0:
        return mx.zeros(lead, mx.float32), mx.zeros(lead, mx.float32)
    with mx.stream(_device(stream)):
        logp, lse = fallback.forward(
            h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), scales, biases,
            group_size=group_size, bits=bits, softcap=softcap,
            ignore_index=ignore_index,
        )
    return logp.reshape(lead), lse.reshape(lead)


def flash_cce_backward(h, w, targets, lse, g, scales=None, biases=None, *,
                       g_lse=None, group_size=64, bits=None, softcap=None,
                       ignore_index=-100, compute_dw=False, stream=None,
                       backend=None, tuning=None):
    """Gradient of `sum(g * logp + g_lse * lse)` from `flash_cce_forward`.

    `lse` is the forward's second output; `g` (and optional `g_lse`) have the
    shape of `targets`. Returns `dh` (shape and dtype of `h`), or `(dh, dw)` when
    `compute_dw` is set for a dense `w` (dtype of `w`). `tuning`: as for
    `flash_cce_forward`.
    """
    bits = _ext.check_args(h, w, targets, scales, biases, group_size, bits, softcap)
    _ext.check_tuning(tuning)
    if compute_dw and scales is not None:
        raise ValueError("[flash_cce] compute_dw needs a dense w: a quantized head is frozen")
    if _use_native(backend, stream, lambda: HeadSpec.of(h, w, scales, bits, group_size), h):
        out = _ext.backward(
            h, w, targets, lse, g, g_lse, scales, biases, group_size=group_size,
            bits=bits, softcap=softcap, ignore_index=ignore_index,
            compute_dw=compute_dw, tuning=tuning, stream=stream,
        )
        return tuple(out) if compute_dw else out[0]
    for name, a in (("lse", lse), ("g", g), ("g_lse", g_lse)):
        if a is not None and a.shape != targets.shape:
            raise ValueError(
                f"[flash_cce] {name} must have shape {targets.shape}, got {a.shape}"
            )
    H = h.shape[-1]
    with mx.stream(_device(stream)):
        dh, dw = fallback.backward(
            h.reshape(-1, H), w, targets.reshape(-1), lse.reshape(-1),
            g.reshape(-1), scales, biases,
            g_lse=None if g_lse is None else g_lse.reshape(-1),
            group_size=group_size, bits=bits, softcap=softcap,
            ignore_index=ignore_index, compute_dw=compute_dw,
        )
    dh = dh.reshape(h.shape)
    if compute_dw:
        return dh, (dw if dw is not None else mx.zeros_like(w))
    return dh
