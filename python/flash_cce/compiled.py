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
(same class, window, parameters and trainable ones) share one compiled
function, traced once per shape: every array they use, frozen weights
included, is an input (environment switches of `attention` and `layers` are
read at that trace).

Covers `KINDS` (Gemma 4's per-layer inputs are inputs of its layers, and the
cotangents of the keys/values a layer shares with later ones reach it with its
output's) and the one-pass layouts of `prefix` (separate sequences, or the
packed prefix batch); the two-pass prefix layout takes the autodiff path, as
does a model with trainable parameters outside its layers.
"""

import contextlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from .attention import PackedMask, causal_mask, routed_block
from .layers import training_layers
from .prefix import PackedCache

KINDS = ("llama", "qwen3", "minicpm", "gemma3_text", "gemma4_text")


def supported(lm):
    """Whether `lm` is of `KINDS` with its trainable parameters all in its layers."""
    if lm.kind not in KINDS:
        return False
    inside = sum(len(tree_flatten(layer.trainable_parameters())) for layer in lm.layers)
    return inside == len(tree_flatten(lm.model.trainable_parameters()))


class _Layers:
    """Compiled forward and VJP of layers alike (`lm`'s layer i the template)."""

    def __init__(self, lm, i):
        template, window = lm.layers[i], lm.windows[i]
        flat = tree_flatten(template.parameters())
        train = {k for k, _ in tree_flatten(template.trainable_parameters())}
        self.names = [k for k, _ in flat]
        self.trainable = [j for j, k in enumerate(self.names) if k in train]
        gemma4, cached = lm.kind == "gemma4_text", lm.has_cache(i)
        # Gemma 4: whether later layers reuse this layer's keys/values, and
        # whether it reads an earlier layer's.
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

        def run(h, aux, shared, offset, packed):
            # As `segmented`'s body calls `lm.layer`: [h] (+ keys, values to share).
            at = mx.array([0] + [packed] * (h.shape[0] - 1)) if packed else offset
            mask = PackedMask(packed, window) if packed else causal_mask(h.shape[1], offset, window)
            cache = PackedCache(at) if packed and cached else None
            if not gemma4:
                return [template(h, mask, cache)]
            h, kv, _ = template(h, mask, cache, per_layer_input=aux, shared_kv=shared,
                                offset=mx.array(at))
            return [h] + (list(kv) if self.shares else [])

        def forward(arrays, h, aux, shared, offset, packed, context):
            with holding(arrays):
                return run(h, aux, shared, offset, packed)

        def backward(arrays, h, aux, shared, cts, offset, packed, context):
            n = len(self.trainable)

            def f(*primals):
                template.update(tree_unflatten(
                    [(self.names[j], p) for j, p in zip(self.trainable, primals)]))
                kv = tuple(primals[n + 1:]) if self.reads else None
                return run(primals[n], aux, kv, offset, packed)

            primals = [arrays[j] for j in self.trainable] + [h] + list(shared or ())
            with holding(arrays):
                _, grads = mx.vjp(f, primals, cts)
            return grads[:n], grads[n], grads[n + 1:]

        self.forward = mx.compile(forward)
        self.backward = mx.compile(backward)

    def params(self, layer):
        return [v for _, v in tree_flatten(layer.parameters())]

    def grads(self, values):
        return tree_unflatten([(self.names[j], g) for j, g in zip(self.trainable, values)])


class Stack:
    """Forward and backward of `lm`'s layers on `[B, L, d]` hidden states at
    positions offset.. (`packed`: a packed prefix batch, see `prefix`)."""

    def __init__(self, lm):
        self.lm = lm
        self.groups = {}

    def _group(self, i):
        lm = self.lm
        layer = lm.layers[i]
        key = (type(layer).__name__, lm.windows[i], lm.has_cache(i), i in lm.sources,
               lm.sources[i] is not None,
               tuple(k for k, _ in tree_flatten(layer.parameters())),
               tuple(k for k, _ in tree_flatten(layer.trainable_parameters())))
        if key not in self.groups:
            self.groups[key] = _Layers(lm, i)
        return self.groups[key]

    def forward(self, h, aux=None, offset=0, packed=None):
        """Runs the layers (`aux`: Gemma 4's per-layer inputs `[B, L, layers, d']`);
        keeps what `backward` needs."""
        lm = self.lm
        self.offset, self.packed = offset, packed or 0
        # A trace holds the attention routing and layer forms of its time
        # (`attention.routed`, `layers.training_layers`): they are part of its key.
        self.context = (routed_block(lm.model), training_layers.active())
        self.inputs, self.aux, self.shared = [], [], {}
        for i, layer in enumerate(lm.layers):
            group = self._group(i)
            a = None if aux is None else aux[:, :, i]
            kv = self.shared.get(lm.sources[i])
            self.inputs.append(h)
            self.aux.append(a)
            out = group.forward(group.params(layer), h, a, kv, offset, self.packed, self.context)
            h = out[0]
            if group.shares:
                self.shared[i] = tuple(out[1:])
        self.shape = h.shape
        return h

    def backward(self, ct):
        """The trainable parameters' gradients (the tree of
        `model.trainable_parameters()`) given the cotangent of the last hidden states."""
        lm = self.lm
        ct = ct.reshape(self.shape)
        grads, kv_cts = [None] * len(lm.layers), {}
        for i in reversed(range(len(lm.layers))):
            group = self._group(i)
            cts = [ct] + (kv_cts.pop(i) if group.shares else [])
            # The recomputation waits for the cotangents, and the cotangent passed on
            # waits for this layer's gradients: one layer's activations at a time.
            (h,) = mx.depends([self.inputs[i]], cts)
            src = lm.sources[i]
            g, ct, kv_ct = group.backward(group.params(lm.layers[i]), h, self.aux[i],
                                          self.shared.get(src), cts, self.offset,
                                          self.packed, self.context)
            if group.reads:
                before = kv_cts.get(src)
                kv_cts[src] = list(kv_ct) if before is None else [
                    a + b for a, b in zip(before, kv_ct)]
            if g:
                (ct,) = mx.depends([ct], list(g))
            grads[i] = group.grads(g)
        self.inputs, self.aux, self.shared = [], [], {}
        return _in_model_tree(lm, grads)


def _in_model_tree(lm, per_layer):
    """Per-layer gradient trees in the tree of `model.trainable_parameters()`."""
    ids = {id(layer): i for i, layer in enumerate(lm.layers)}
    by_path = {}
    for name, module in lm.model.named_modules():
        i = ids.get(id(module))
        if i is not None:
            by_path.update((f"{name}.{k}", v) for k, v in tree_flatten(per_layer[i]))
    return tree_map_with_path(lambda path, _: by_path[path], lm.model.trainable_parameters())


def stack_for(lm):
    """The model's `Stack`, kept on the model across steps so that its compiled
    layers are reused (and released with it)."""
    stack = getattr(lm.model, "_flash_cce_stack", None)
    if stack is None:
        stack = Stack(lm)
        lm.model._flash_cce_stack = stack  # an attribute, not a parameter
    stack.lm = lm
    return stack
