"""A group's completions differentiated a few at a time around one prompt pass.

The prompt runs once and its keys/values (and its last hidden state, which
predicts every completion's first token) are kept. Each micro-group of
completions then runs as the continuation of that prompt (the two-pass layout
of `prefix`) under its own `value_and_grad`, which returns the gradients of its
share of the loss with respect to the trainable parameters and to the prompt's
keys/values and last hidden state. The latter are summed over the micro-groups
and taken back through the prompt in one last pass (`mx.vjp` of the prompt's
forward), so the gradients equal those of the whole group while one
micro-group's activations are held: the peak stops growing with the number of
completions.

Exact for a loss that is a sum of per-completion terms (each row of the `[G, T]`
outputs enters only its own term), which GRPO's group share is: each
micro-group's pass sees the other rows as constants (zeros).
"""

import contextlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import layers
from .segmented import run_stack


@contextlib.contextmanager
def _mlx_gelu():
    """MLX's own `nn.gelu_approx` for a forward outside any gradient: the
    training layers' is a custom function, which compiled callers (Gemma's
    `geglu`) cannot trace there. Same values."""
    saved = nn.gelu_approx
    nn.gelu_approx = layers._mlx_gelu_approx
    try:
        yield
    finally:
        nn.gelu_approx = saved


def _params_fn(model, fn):
    """`fn` as a function of the flat list of the trainable parameters first."""
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]

    def call(flat, *args):
        model.update(tree_unflatten(list(zip(names, flat))))
        return fn(*args)

    return call, [v for _, v in tree_flatten(model.trainable_parameters())], names


def micro_value_and_grad(run, group, plan, loss, size, outputs_of):
    """(outputs `[G, T]`, gradient tree) of `loss(out)` over `group`, its
    completions `size` at a time. `outputs_of(h, rows, completions, width)`:
    the outputs (a dict of `[n, width]` arrays) of completions whose hidden
    states are `h` with `rows` as in `prefix.sequence_hidden`."""
    lm, model = run.lm, run.lm.model
    prompt = list(group.prompt)
    p, G = len(prompt), len(group.completions)
    width = max(map(len, group.completions))

    def prompt_pass():
        h, kv = run_stack(lm, *lm.embed(mx.array([prompt])), keep_kv=True, segment_size=plan.segment_size)
        return [h[0, -1]] + [x for pair in kv for x in pair]

    prompt_call, flat, names = _params_fn(model, prompt_pass)
    with _mlx_gelu():
        outs = prompt_call(flat)
        mx.eval(outs)
    last, kv = outs[0], [tuple(outs[1 + 2 * j:3 + 2 * j]) for j in range((len(outs) - 1) // 2)]

    parts, grads, cts = [], None, None
    for lo in range(0, G, size):
        comps = group.completions[lo:lo + size]

        def micro(last, kv, comps=comps, lo=lo):
            conts = [list(c[:-1]) for c in comps]
            n = max(map(len, conts))
            hs = [last[None]]
            if n:
                tokens = mx.array([c + [0] * (n - len(c)) for c in conts])
                hc, _ = run_stack(lm, *lm.embed(tokens), offset=p, prompt_kv=kv, segment_size=plan.segment_size)
                hs.append(hc.reshape(-1, hc.shape[-1]))
            h = mx.concatenate(hs, axis=0)
            # Row 0 is the prompt's last position (it predicts token 0), so the
            # prompt rows p - 1.. of `prefix.sequence_hidden` map to 0.. here.
            rows = [[None] * (p - 1) + [0] + [1 + b * n + k for k in range(len(c))] for b, c in enumerate(conts)]
            out = outputs_of(h, rows, comps, width)
            full = {k: mx.concatenate([mx.zeros((lo, width), v.dtype), v,
                                       mx.zeros((G - lo - len(comps), width), v.dtype)]) for k, v in out.items()}
            return loss(full), out

        call, _, _ = _params_fn(model, micro)
        (_, out), (g, g_last, g_kv) = mx.value_and_grad(call, argnums=(0, 1, 2))(flat, last, kv)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        ct = [g_last] + [x for pair in g_kv for x in pair]
        cts = ct if cts is None else [a + b for a, b in zip(cts, ct)]
        parts.append(tree_map(mx.stop_gradient, out))
        mx.eval(grads, cts, parts[-1])

    # The prompt's share: its forward again, its gradient from the summed cotangents.
    _, g = mx.vjp(lambda *xs: prompt_call(list(xs)), flat, cts)
    grads = [a + b for a, b in zip(grads, g)]
    model.update(tree_unflatten(list(zip(names, flat))))
    out = {k: mx.concatenate([o[k] for o in parts]) for k in parts[0]}
    return out, tree_unflatten(list(zip(names, grads)))
