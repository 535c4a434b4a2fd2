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

Covers architectures whose layers need nothing but their input (llama, qwen3,
minicpm, gemma3_text) and the one-pass layouts of `prefix` (separate
sequences, or the packed prefix batch). Gemma 4 (keys/values shared across
layers, per-layer inputs) and the two-pass prefix layout take the autodiff path.
"""

import contextlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from .attention import PackedMask, causal_mask, routed_block
from .layers import training_layers
from .prefix import PackedCache

KINDS = ("llama", "qwen3", "minicpm", "gemma3_text")


def supported(lm):
    """Whether `lm`'s trainable parameters all sit in its layers, which need
    nothing but their input."""
    if lm.kind not in KINDS:
        return False
    inside = sum(len(tree_flatten(layer.trainable_parameters())) for layer in lm.layers)
    return inside == len(tree_flatten(lm.model.trainable_parameters()))


class _Layers:
    """Compiled forward and VJP of layers alike (one template layer)."""

    def __init__(self, template, window):
        flat = tree_flatten(template.parameters())
        train = {k for k, _ in tree_flatten(template.trainable_parameters())}
        self.names = [k for k, _ in flat]
        self.trainable = [j for j, k in enumerate(self.names) if k in train]

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

        def run(h, offset, packed):
            if packed:
                at = mx.array([0] + [packed] * (h.shape[0] - 1))
                return template(h, PackedMask(packed, window), PackedCache(at))
            return template(h, causal_mask(h.shape[1], offset, window), None)

        def forward(arrays, h, offset, packed, context):
            with holding(arrays):
                return run(h, offset, packed)

        def backward(arrays, h, ct, offset, packed, context):
            def f(*primals):
                template.update(tree_unflatten(
                    [(self.names[j], p) for j, p in zip(self.trainable, primals)]))
                return [run(primals[-1], offset, packed)]

            with holding(arrays):
                _, grads = mx.vjp(f, [arrays[j] for j in self.trainable] + [h], [ct])
            return grads[:-1], grads[-1]

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
        layer = self.lm.layers[i]
        key = (type(layer).__name__, self.lm.windows[i],
               tuple(k for k, _ in tree_flatten(layer.parameters())),
               tuple(k for k, _ in tree_flatten(layer.trainable_parameters())))
        if key not in self.groups:
            self.groups[key] = _Layers(layer, self.lm.windows[i])
        return self.groups[key]

    def forward(self, h, offset=0, packed=None):
        """Runs the layers; keeps their inputs for `backward`."""
        self.offset, self.packed, self.inputs = offset, packed or 0, []
        # A trace holds the attention routing and layer forms of its time
        # (`attention.routed`, `layers.training_layers`): they are part of its key.
        self.context = (routed_block(self.lm.model), training_layers.active())
        for i, layer in enumerate(self.lm.layers):
            self.inputs.append(h)
            group = self._group(i)
            h = group.forward(group.params(layer), h, offset, self.packed, self.context)
        self.shape = h.shape
        return h

    def backward(self, ct):
        """The trainable parameters' gradients (the tree of
        `model.trainable_parameters()`) given the cotangent of the last hidden states."""
        ct = ct.reshape(self.shape)
        grads = [None] * len(self.lm.layers)
        for i in reversed(range(len(self.lm.layers))):
            group = self._group(i)
            # The recomputation waits for the cotangent, and the cotangent passed on
            # waits for this layer's gradients: one layer's activations at a time.
            (h,) = mx.depends([self.inputs[i]], [ct])
            g, ct = group.backward(group.params(self.lm.layers[i]), h, ct, self.offset,
                                   self.packed, self.context)
            if g:
                (ct,) = mx.depends([ct], list(g))
            grads[i] = group.grads(g)
        self.inputs = []
        return _in_model_tree(self.lm, grads)


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
