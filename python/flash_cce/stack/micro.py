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
completions. With the plan's compiled layers (`compiled.Stack`) each
micro-group's continuation is taken back alone (`Stack.backward_latest`) and the
prompt's pass last, with the summed cotangents of its keys/values; otherwise
the passes run under MLX's autodiff with `segmented`'s checkpoints.

Exact for a loss that is a sum of per-completion terms (each row of the `[G, T]`
outputs enters only its own term), which GRPO's group share is: each
micro-group's pass sees the other rows as constants (zeros).
"""

import contextlib
import functools

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import compiled, layers
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


def micro_value_and_grad(run, group, plan, loss, size, outputs_of):
    """(outputs `[G, T]`, gradient tree) of `loss(out)` over `group`, its
    completions `size` at a time. `outputs_of(h, rows, completions, width)`:
    the outputs (a dict of `[n, width]` arrays) of completions whose hidden
    states are `h` with `rows` as in `prefix.sequence_hidden`."""
    prompt = list(group.prompt)
    p, G = len(prompt), len(group.completions)
    width = max(map(len, group.completions))
    passes = (_Compiled if plan.compiled else _Autodiff)(run.lm, plan.segment_size)
    passes.prompt(prompt)

    def loss_of(lo, comps, last, hc):
        # Row 0 is the prompt's last position (it predicts token 0), so the
        # prompt rows p - 1.. of `prefix.sequence_hidden` map to 0.. here.
        n = max(len(c) for c in comps) - 1
        hs = [last[None]] + ([hc.reshape(-1, hc.shape[-1])] if hc is not None else [])
        rows = [[None] * (p - 1) + [0] + [1 + b * n + k for k in range(len(c) - 1)] for b, c in enumerate(comps)]
        out = outputs_of(mx.concatenate(hs, axis=0), rows, comps, width)
        full = {k: mx.concatenate([mx.zeros((lo, width), v.dtype), v,
                                   mx.zeros((G - lo - len(comps), width), v.dtype)]) for k, v in out.items()}
        return loss(full), out

    parts = []
    for lo in range(0, G, size):
        comps = group.completions[lo:lo + size]
        conts = [list(c[:-1]) for c in comps]
        n = max(map(len, conts))
        tokens = mx.array([c + [0] * (n - len(c)) for c in conts]) if n else None
        out = passes.micro(tokens, p, functools.partial(loss_of, lo, comps))
        parts.append(tree_map(mx.stop_gradient, out))
        mx.eval([x for _, x in tree_flatten(passes.sums) if x is not None], parts[-1])
    out = {k: mx.concatenate([o[k] for o in parts]) for k in parts[0]}
    return out, passes.finish()


def _plus(a, b):
    """a + b, leaf by leaf, where either tree may be None (nothing summed yet)."""
    return b if a is None else a if b is None else tree_map(mx.add, a, b)


class _Autodiff:
    """The passes under `mx.value_and_grad` of the trainable parameters (a flat
    list) and the prompt's last hidden state and keys/values."""

    def __init__(self, lm, segment_size):
        self.lm, self.segment_size = lm, segment_size
        self.names = [k for k, _ in tree_flatten(lm.model.trainable_parameters())]
        self.flat = [v for _, v in tree_flatten(lm.model.trainable_parameters())]
        self.sums = None  # (parameter gradients, prompt output cotangents)

    def _call(self, fn):
        def call(flat, *args):
            self.lm.model.update(tree_unflatten(list(zip(self.names, flat))))
            return fn(*args)
        return call

    def _prompt_pass(self):
        h, kv = run_stack(self.lm, *self.lm.embed(mx.array([self.tokens])), keep_kv=True,
                          segment_size=self.segment_size)
        return [h[0, -1]] + [x for pair in kv for x in pair]

    def prompt(self, tokens):
        self.tokens = tokens
        with _mlx_gelu():
            outs = self._call(self._prompt_pass)(self.flat)
            mx.eval(outs)
        self.last, self.kv = outs[0], [tuple(outs[1 + 2 * j:3 + 2 * j]) for j in range((len(outs) - 1) // 2)]

    def micro(self, tokens, p, loss_of):
        def f(last, kv):
            hc = None
            if tokens is not None:
                hc, _ = run_stack(self.lm, *self.lm.embed(tokens), offset=p, prompt_kv=kv,
                                  segment_size=self.segment_size)
            return loss_of(last, hc)

        (_, out), (g, g_last, g_kv) = mx.value_and_grad(self._call(f), argnums=(0, 1, 2))(
            self.flat, self.last, self.kv)
        self.sums = _plus(self.sums, (g, [g_last] + [x for pair in g_kv for x in pair]))
        return out

    def finish(self):
        # The prompt's share: its forward again, its gradient from the summed cotangents.
        grads, cts = self.sums
        _, g = mx.vjp(lambda *xs: self._call(self._prompt_pass)(list(xs)), self.flat, cts)
        self.lm.model.update(tree_unflatten(list(zip(self.names, self.flat))))
        return tree_unflatten(list(zip(self.names, [a + b for a, b in zip(grads, g)])))


class _Compiled:
    """The passes through the compiled layers: the prompt's pass kept on the
    stack's tape while each micro-group's continuation is taken back."""

    def __init__(self, lm, segment_size):
        self.lm, self.stack = lm, compiled.stack_for(lm)
        self.sums = None  # (gradient tree, last-state cotangent, {layer: keys/values cotangents}), fp32

    def prompt(self, tokens):
        hp, self.kv = self.stack.forward(*self.lm.embed(mx.array([tokens])), keep_kv=True)
        self.last = hp[0, -1]

    def micro(self, tokens, p, loss_of):
        if tokens is None:
            (_, out), g_last = mx.value_and_grad(lambda last: loss_of(last, None))(self.last)
            g, kv_cts = None, {}
        else:
            hc, _ = self.stack.forward(*self.lm.embed(tokens), offset=p, prompt_kv=self.kv)
            (_, out), (g_last, g_c) = mx.value_and_grad(loss_of, argnums=(0, 1))(self.last, hc)
            g, kv_cts = self.stack.backward_latest(g_c)
        f32 = lambda x: x.astype(mx.float32)  # noqa: E731
        grads, last, kv = self.sums or (None, None, {})
        for i, cts in kv_cts.items():
            kv[i] = _plus(kv.get(i), [f32(c) for c in cts])
        self.sums = (_plus(grads, g), _plus(last, f32(g_last)), kv)
        return out

    def finish(self):
        # The prompt's pass last: its output's cotangent sits on its last row.
        grads, last, kv_cts = self.sums
        p = self.stack.tapes[-1].shape[1]
        ct = mx.concatenate([mx.zeros((p - 1, last.shape[-1]), self.last.dtype), last.astype(self.last.dtype)[None]])
        kinds = {i: [x.dtype for x in pair] for i, pair in zip(self._cached(), self.kv)}
        g = self.stack.backward(ct, recorded={i: [c.astype(t) for c, t in zip(cts, kinds[i])]
                                              for i, cts in kv_cts.items()})
        return g if grads is None else tree_map(mx.add, grads, g)

    def _cached(self):
        # The layers whose keys/values the prompt's pass recorded, in order.
        return [i for i in range(len(self.lm.layers)) if self.lm.has_cache(i)]
