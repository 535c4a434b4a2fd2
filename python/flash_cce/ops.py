"""The flash-CCE head ops: validation, backend choice, and the two primitives.

The backend of a call that names none comes from the environment variable
FLASH_CCE_BACKEND ("auto", "native" or "fallback"; unset means "auto").
"""

import math
import os
from typing import NamedTuple

import mlx.core as mx

from . import _ext, fallback, metal
from .selfcheck import HeadSpec

_BACKENDS = (None, "auto", "native", "fallback")


class TokenStats(NamedTuple):
    """Per-token results of a head call with `entropy=True`, each of shape
    `targets.shape`: `logp` (float32), `entropy` of the softmax over the final
    logits (float32), `lse` (float32), `is_top1` (bool: the target is the
    arg-max, the first one on ties), `mean_logit` (float32, over the
    vocabulary). `logp`, `entropy` and `lse` are differentiable; `is_top1`
    and `mean_logit` are statistics and take no gradient."""

    logp: mx.array
    entropy: mx.array
    lse: mx.array
    is_top1: mx.array
    mean_logit: mx.array


def check_temperature(temperature):
    """`temperature` as a float; ValueError unless it is a finite number > 0."""
    ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not ok or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"[flash_cce] temperature must be a finite number > 0, got {temperature!r}"
        )
    return float(temperature)


def check_flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"[flash_cce] {name} must be True or False, got {value!r}")


def _tempered(h, softcap, temperature, stream):
    """(h, softcap) of the same head with the logits divided by `temperature`.

    cap tanh(h W^T / cap) / T = (cap / T) tanh((h / T) W^T / (cap / T)), so the
    temperature folds into h (scaled in float32: one rounding) and the cap;
    every backend then runs its usual kernels and autodiff carries 1/T into dh."""
    if temperature == 1.0:
        return h, softcap
    with mx.stream(_device(stream)):
        h = h.astype(mx.float32) * (1.0 / temperature)
    return h, None if softcap is None else softcap / temperature


def _kernel_h(h, h_in, stream):
    """The tempered `h` as the GPU kernels should read it: in `h_in`'s own type,
    as they read an untempered h (a float32 product would send a float16 h to
    bf16 operands). The CPU kernels and the fallback take the float32 product."""
    if h is h_in or h_in.dtype == mx.float32 or _device(stream).type != mx.gpu:
        return h
    with mx.stream(_device(stream)):
        return h.astype(h_in.dtype)


def _stats(out):
    """TokenStats from the backends' order (logp, lse, entropy, is_top1, mean_logit)."""
    logp, lse, entropy, is_top1, mean_logit = out
    return TokenStats(logp, entropy, lse, is_top1, mean_logit)


def native_stats(device):
    """Whether the native kernels of `device` compute the entropy statistics
    (the CPU's, CUDA's and Metal's; on a Metal GPU only configurations that
    passed the self-check, which covers them, run natively); calls that
    request them elsewhere run the fallback."""
    return _ext.supports_stats(_device(device))


def fused_stats(device):
    """Whether the native kernels of `device` keep the entropy statistics in
    the fused forward (the CPU's). The GPU kernels compute them in the plain
    forward, so asking for them turns the fused backward off there."""
    return _device(device).type == mx.cpu


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


def _use_native(backend, stream, spec=None, h=None, entropy=False):
    """Whether a call runs the native kernels. `spec` (a function returning the
    call's HeadSpec, made only where needed) and `h` let "auto" consult the
    Metal gate: on a Metal GPU the kernels run only for configurations that
    passed the self-check (with `entropy`, also its entropy part), and sizes
    they index (metal.py)."""
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
    return metal.fits(h) and metal.GATE.allows(spec(), entropy=entropy)


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
                      tuning=None, temperature=1.0, entropy=False):
    """Per-token log-probabilities of a linear head without materialising logits.

    Args:
        h: hidden states `[..., H]` (float32, bfloat16 or float16).
        w: head weight `[V, H]` (dense float), or `mx.quantize`'s packed uint32
            `[V, H * bits / 32]` with `scales` and `biases` `[V, H / group_size]`.
        targets: integer `[...]` (= `h.shape[:-1]`); `ignore_index` rows give 0.
        softcap: Gemma's final logit softcap `cap * tanh(s / cap)`, or None.
        temperature: a number > 0 dividing the logits after the softcap
            (`softcap(s) / temperature`, TRL's order), in forward and backward.
        entropy: also return the entropy of the softmax over the final logits
            (differentiable) and the statistics `is_top1` and `mean_logit`, as
            a `TokenStats`.
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
        `logp = s[y] - logsumexp(s)` and `lse = logsumexp(s)`; with `entropy`,
        a `TokenStats`. Differentiable in `h` and in a dense `w` (`mx.grad`,
        `mx.compile`, `mx.vmap`).
    """
    bits = _ext.check_args(h, w, targets, scales, biases, group_size, bits, softcap)
    _ext.check_tuning(tuning)
    temperature = check_temperature(temperature)
    check_flag("entropy", entropy)
    check_flag("fused_backward", fused_backward)
    if validate_targets:
        check_targets(targets, w.shape[0], ignore_index)
    h_in = h
    h, softcap = _tempered(h, softcap, temperature, stream)
    native = _use_native(backend, stream, lambda: HeadSpec.of(h, w, scales, bits, group_size), h,
                         entropy)
    kw = dict(group_size=group_size, bits=bits, softcap=softcap, ignore_index=ignore_index)
    if native and not entropy:
        logp, lse = _ext.forward(_kernel_h(h, h_in, stream), w, targets, scales, biases, **kw,
                                 fused_backward=fused_backward, tuning=tuning, stream=stream)
        return logp, lse
    if native and native_stats(stream):
        out = _ext.forward(_kernel_h(h, h_in, stream), w, targets, scales, biases, **kw,
                           fused_backward=fused_backward, tuning=tuning, stream=stream, stats=True)
        return _stats(out)
    lead = targets.shape
    if targets.size == 0:
        zeros = [mx.zeros(lead, mx.float32) for _ in range(4)]
        if entropy:
            return TokenStats(*zeros[:3], mx.zeros(lead, mx.bool_), zeros[3])
        return tuple(zeros[:2])
    with mx.stream(_device(stream)):
        out = fallback.forward(h.reshape(-1, h_in.shape[-1]), w, targets.reshape(-1),
                               scales, biases, **kw, stats=entropy)
    out = [a.reshape(lead) for a in out]
    return _stats(out) if entropy else tuple(out)


def flash_cce_backward(h, w, targets, lse, g, scales=None, biases=None, *,
                       g_lse=None, group_size=64, bits=None, softcap=None,
                       ignore_index=-100, compute_dw=False, stream=None,
                       backend=None, tuning=None, temperature=1.0, entropy=None,
                       g_entropy=None):
    """Gradient of `sum(g * logp + g_lse * lse + g_entropy * entropy)` from
    `flash_cce_forward` (called with the same `softcap` and `temperature`).

    `lse` (and `entropy`, needed with `g_entropy`) are the forward's outputs;
    `g`, `g_lse` and `g_entropy` have the shape of `targets`. Returns `dh`
    (shape and dtype of `h`), or `(dh, dw)` when `compute_dw` is set for a dense
    `w` (dtype of `w`). `tuning`: as for `flash_cce_forward`.
    """
    bits = _ext.check_args(h, w, targets, scales, biases, group_size, bits, softcap)
    _ext.check_tuning(tuning)
    temperature = check_temperature(temperature)
    if compute_dw and scales is not None:
        raise ValueError("[flash_cce] compute_dw needs a dense w: a quantized head is frozen")
    if (g_entropy is None) != (entropy is None):
        raise ValueError("[flash_cce] g_entropy and entropy (the forward's output) "
                         "must be given together")
    for name, a in (("lse", lse), ("g", g), ("g_lse", g_lse), ("entropy", entropy),
                    ("g_entropy", g_entropy)):
        if a is not None and a.shape != targets.shape:
            raise ValueError(
                f"[flash_cce] {name} must have shape {targets.shape}, got {a.shape}"
            )
    h_in = h
    h, softcap = _tempered(h, softcap, temperature, stream)
    kw = dict(group_size=group_size, bits=bits, softcap=softcap, ignore_index=ignore_index)
    native = _use_native(backend, stream, lambda: HeadSpec.of(h, w, scales, bits, group_size), h,
                         g_entropy is not None)
    if native and (g_entropy is None or native_stats(stream)):
        extra = {} if g_entropy is None else dict(entropy=entropy, g_entropy=g_entropy)
        out = _ext.backward(_kernel_h(h, h_in, stream), w, targets, lse, g, g_lse, scales, biases, **kw,
                            **extra, compute_dw=compute_dw, tuning=tuning, stream=stream)
        dh, dw = out[0], (out[1] if compute_dw else None)
    else:
        flat = [None if a is None else a.reshape(-1) for a in (g_lse, entropy, g_entropy)]
        with mx.stream(_device(stream)):
            dh, dw = fallback.backward(
                h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), lse.reshape(-1),
                g.reshape(-1), scales, biases, g_lse=flat[0], entropy=flat[1],
                g_entropy=flat[2], **kw, compute_dw=compute_dw,
            )
        dh = dh.reshape(h.shape)
    if temperature != 1.0:
        with mx.stream(_device(stream)):
            dh = (dh * (1.0 / temperature)).astype(h_in.dtype)
    if compute_dw:
        return dh, (dw if dw is not None else mx.zeros_like(w))
    return dh
