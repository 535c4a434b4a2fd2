"""The decoder stack's gradient layer by layer, each layer's forward and VJP
compiled (`mx.compile`), outside MLX's autodiff of the whole step.

Inside `value_and_grad` every array that depends on the trainable parameters is
a tracer, and `mx.compile` runs a function on tracers uncompiled; the layers'
elementwise work then costs MLX one graph node each, and a short pair's step
is bound by the host building and encoding those nodes. Here the forward runs
the layers without a transformation, keeping each layer's input (as the
one-layer checkpoint segments do), the objective's `value_and_grad` reaches
only the final hidden states, and the backward calls one compiled VJP per
layer: it recomputes the layer from its input and returns the cotangent of the
input and the gradients of the layer's trainable parameters. Layers alike
(same class, window, parameters, trainable ones and Python settings) share one
compiled function, traced once per shape: every array they use, frozen weights
included, is an input (whether `fused`'s kernels run is decided at that
trace).

Covers every architecture of `lm` and every layout of `prefix`: Gemma 4's
per-layer inputs are inputs of its layers, and the cotangents of the
keys/values that a layer shares with later layers, or records for the
responses' pass after a prompt, reach it with its output's. A model with
trainable parameters outside its layers, or with active dropout, takes the
autodiff path.
"""

import contextlib
import functools
import itertools
import math
import operator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

from .attention import routed_block
from .layers import training_layers
from .segmented import layer_cache, layer_mask, positions


def supported(lm):
    """Whether `lm`'s trainable parameters all sit in its layers (every
    architecture `LM` takes, in every layout of `prefix`) and its layers draw no
    random numbers (active dropout: a trace would replay one mask)."""
    inside = sum(len(tree_flatten(layer.trainable_parameters())) for layer in lm.layers)
    if inside != len(tree_flatten(lm.model.trainable_parameters())):
        return False
    return not draws_random(lm)


def draws_random(lm):
    """Whether `lm`'s layers draw random numbers (active dropout), so that a
    second run of a forward differs from the first."""
    return any(isinstance(m, nn.Dropout) and m.training and m._p_1 < 1
               for layer in lm.layers for _, m in layer.named_modules())


def _settings(layer):
    # The Python numbers a trace bakes in (LoRA scales, windows, training
    # flags): layers alike must agree on them, and a change must trace again
    # (`lm.adapters_off` sets the scales to 0). mlx-lm's layers keep their
    # index only for their messages.
    return tuple((name, k, v) for name, m in layer.named_modules()
                 for k, v in sorted(vars(m).items())
                 if isinstance(v, (bool, int, float, str)) and k != "layer_idx")


class _Layers:
    """Compiled forward and VJP of layers alike (`lm`'s layer i the template).

    `mode`: "plain", "packed" (a packed prefix batch), "record" (a prompt whose
    keys/values the continuation reads) or "continue" (responses after `prompt`,
    that layer's prompt keys/values)."""

    def __init__(self, lm, i):
        template, window = lm.layers[i], lm.windows[i]
        flat = tree_flatten(template.parameters())
        train = {k for k, _ in tree_flatten(template.trainable_parameters())}
        self.names = [k for k, _ in flat]
        self.trainable = [j for j, k in enumerate(self.names) if k in train]
        # Gemma 4: whether later layers reuse this layer's keys/values, and
        # whether it reads an earlier layer's (then it has no cache of its own).
        self.cached = lm.has_cache(i)
        self.shares, self.reads = i in lm.sources, lm.sources[i] is not None

        @contextlib.contextmanager
        def holding(arrays):
            # The template computes with `arrays` until the VJP is built: custom
            # VJPs (`layers.dequantized_linear`) read their layer's weights then.
            saved = template.parameters()
            template.update(tree_unflatten(list(zip(self.names, arrays))))
            try:
                yield
            finally:
                template.update(saved)

        def run(h, aux, shared, prompt, offset, packed, mode):
            # As `segmented`'s body calls `lm.layer` (i is the template): [h] (+ the
            # keys/values it records or shares: one pair, returned once, as they
            # are the same).
            at = positions(h, offset, packed)
            cache = layer_cache(lm, i, at, packed, prompt, mode == "record")
            h, kv = lm.layer(i, h, layer_mask(h.shape[1], offset, packed, window), cache, aux,
                             shared, at)
            if mode == "record" and self.cached:
                return [h, *cache.kv]
            return [h, *kv] if self.shares else [h]

        def forward(arrays, h, aux, shared, prompt, offset, packed, mode, context):
            with holding(arrays):
                return run(h, aux, shared, prompt, offset, packed, mode)

        def backward(arrays, h, aux, shared, prompt, cts, offset, packed, mode, context):
            n = len(self.trainable)
            n_shared = 2 if self.reads else 0

            def f(*primals):
                template.update(tree_unflatten(
                    [(self.names[j], p) for j, p in zip(self.trainable, primals)]))
                rest = primals[n + 1:]
                kv = tuple(rest[:n_shared]) if self.reads else None
                pk = tuple(rest[n_shared:]) if prompt is not None else None
                return run(primals[n], aux, kv, pk, offset, packed, mode)

            primals = ([arrays[j] for j in self.trainable] + [h] + list(shared or ())
                       + list(prompt or ()))
            with holding(arrays):
                _, grads = mx.vjp(f, primals, cts)
            return grads[:n], grads[n], grads[n + 1:n + 1 + n_shared], grads[n + 1 + n_shared:]

        self.forward = mx.compile(forward)
        self.backward = mx.compile(backward)

    def params(self, layer):
        return [v for _, v in tree_flatten(layer.parameters())]

    def grads(self, values):
        return tree_unflatten([(self.names[j], g) for j, g in zip(self.trainable, values)])


class _Tape:
    """What one forward keeps for its backward."""

    def __init__(self, mode, offset, packed, context):
        self.mode, self.offset, self.packed, self.context = mode, offset, packed, context
        self.layers = []  # per layer: (input, aux, shared kv, prompt kv, kv it emitted)


class Stack:
    """Forward and backward of `lm`'s layers on `[B, L, d]` hidden states at
    positions offset.. . Each `forward` adds a pass; `backward` takes the
    cotangent of the passes' outputs flattened to rows and concatenated, as
    `prefix.sequence_hidden` joins them."""

    def __init__(self, lm):
        self.lm = lm
        self.groups, self.step_groups = {}, {}
        self.tapes, self.keep = [], True

    def _group(self, i):
        # Once per layer and step (`stack_for` forgets them): the settings scan
        # walks every module of the layer.
        if i not in self.step_groups:
            self.step_groups[i] = self._find_group(i)
        return self.step_groups[i]

    def _find_group(self, i):
        lm = self.lm
        layer = lm.layers[i]
        key = (type(layer).__name__, lm.windows[i], lm.has_cache(i), i in lm.sources,
               lm.sources[i] is not None, _settings(layer),
               tuple(k for k, _ in tree_flatten(layer.parameters())),
               tuple(k for k, _ in tree_flatten(layer.trainable_parameters())))
        if key not in self.groups:
            self.groups[key] = _Layers(lm, i)
        return self.groups[key]

    def forward(self, h, aux=None, *, offset=0, packed=None, keep_kv=False, prompt_kv=None):
        """Runs the layers as `segmented.run_stack` does (same arguments); returns
        `(h, kv)`, kv being the recorded keys/values of every cached layer with
        `keep_kv`."""
        lm = self.lm
        mode = ("packed" if packed else "record" if keep_kv
                else "continue" if prompt_kv else "plain")
        # A trace holds the attention routing and layer forms of its time
        # (`attention.routed`, `layers.training_layers`): they are part of its key.
        tape = _Tape(mode, offset, packed or 0,
                     (routed_block(lm.model), training_layers.active()))
        prompt = iter(prompt_kv or [])
        shared, recorded = {}, []
        for i, layer in enumerate(lm.layers):
            group = self._group(i)
            a = None if aux is None else aux[:, :, i]
            kv = shared.get(lm.sources[i])
            pk = next(prompt) if mode == "continue" and group.cached else None
            out = group.forward(group.params(layer), h, a, kv, pk, offset, tape.packed, mode,
                                tape.context)
            extra = tuple(out[1:])
            if self.keep:
                tape.layers.append((h, a, kv, pk, extra))
            h = out[0]
            _start(h, *extra)
            if group.shares:
                shared[i] = extra
            if mode == "record" and group.cached:
                recorded.append(extra)
        tape.shape = h.shape
        if self.keep:
            self.tapes.append(tape)
        return h, recorded

    def backward(self, ct, recorded=None):
        """The trainable parameters' gradients (the tree of
        `model.trainable_parameters()`) given the cotangent of the passes'
        outputs, `[rows, d]` in the order of the passes. `recorded`: the
        cotangents (by layer) of the keys/values the latest pass recorded, from
        continuations taken back before (`backward_latest`)."""
        tapes, self.tapes = self.tapes, []
        sizes = [math.prod(t.shape[:-1]) for t in tapes]
        cts = mx.split(ct, list(itertools.accumulate(sizes[:-1]))) if len(tapes) > 1 else [ct]
        grads, prompt_cts = None, recorded or {}
        for tape, c in zip(reversed(tapes), reversed(cts)):
            g, prompt_cts = self._backward(tape, c.reshape(tape.shape), prompt_cts)
            grads = g if grads is None else [tree_map(mx.add, a, b) for a, b in zip(grads, g)]
        return _in_model_tree(self.lm, grads)

    def backward_latest(self, ct):
        """The latest pass taken back alone: (the gradients as `backward` gives
        them, the cotangents of the prompt keys/values it read, by layer). The
        earlier passes stay for `backward`."""
        tape = self.tapes.pop()
        grads, prompt_cts = self._backward(tape, ct.reshape(tape.shape), {})
        return _in_model_tree(self.lm, grads), prompt_cts

    def _backward(self, tape, ct, recorded_cts):
        """Per-layer gradients of one pass, and (a continuation) the cotangents of
        the prompt keys/values it read, by layer. `recorded_cts`: those of the
        keys/values this pass recorded."""
        lm = self.lm
        grads, kv_cts, prompt_cts = [None] * len(lm.layers), {}, {}
        for i in reversed(range(len(lm.layers))):
            group = self._group(i)
            h, a, kv, pk, emitted = tape.layers[i]
            cts = [ct]
            if emitted:
                # Read by later layers (shared) and/or by the next pass (recorded);
                # a prompt without responses leaves its recorded ones unread.
                parts = [p for p in (kv_cts.pop(i, None), recorded_cts.get(i)) if p is not None]
                cts += ([functools.reduce(operator.add, x) for x in zip(*parts)] if parts
                        else [mx.zeros_like(x) for x in emitted])
            # The recomputation waits for the cotangents, and the cotangent passed on
            # waits for this layer's gradients: one layer's activations at a time.
            (h,) = mx.depends([h], cts)
            g, ct, kv_ct, pk_ct = group.backward(group.params(lm.layers[i]), h, a, kv, pk, cts,
                                                 tape.offset, tape.packed, tape.mode,
                                                 tape.context)
            if group.reads:
                src = lm.sources[i]
                before = kv_cts.get(src)
                kv_cts[src] = list(kv_ct) if before is None else [
                    x + y for x, y in zip(before, kv_ct)]
            if pk is not None:
                prompt_cts[i] = list(pk_ct)
            if g:
                (ct,) = mx.depends([ct], list(g))
            _start(ct, *g, *kv_ct, *pk_ct)
            grads[i] = group.grads(g)
        return grads, prompt_cts


def _start(*arrays):
    """Starts evaluating a layer's results while Python builds the next layer's
    calls (the device would wait for the whole step's graph otherwise); inside
    a transformation, where MLX does not allow it, nothing."""
    try:
        mx.async_eval(*arrays)
    except ValueError:
        pass


def _in_model_tree(lm, per_layer):
    """Per-layer gradient trees in the tree of `model.trainable_parameters()`."""
    ids = {id(layer): i for i, layer in enumerate(lm.layers)}
    by_path = {}
    for name, module in lm.model.named_modules():
        i = ids.get(id(module))
        if i is not None:
            by_path.update((f"{name}.{k}", v) for k, v in tree_flatten(per_layer[i]))
    return tree_map_with_path(lambda path, _: by_path[path], lm.model.trainable_parameters())


def stack_for(lm, backward=True):
    """The model's `Stack` with no passes yet, kept on the model across steps so
    that its compiled layers are reused (and released with it). Without
    `backward` its forwards keep nothing."""
    stack = getattr(lm.model, "_flash_cce_stack", None)
    if stack is None:
        stack = Stack(lm)
        lm.model._flash_cce_stack = stack  # an attribute, not a parameter
    # A step that failed between its forward and backward leaves its passes.
    stack.lm, stack.tapes, stack.step_groups, stack.keep = lm, [], {}, backward
    return stack
