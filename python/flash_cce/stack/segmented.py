"""The decoder stack, run plainly or checkpointed over segments of layers.

With `segment_size = k > 0` the layers run in segments of k under `checkpoint`
(an ordered `mx.checkpoint`): the forward keeps only each segment's input
(hidden states, the prompt keys/values it reads, Gemma 4's shared keys/values
and per-layer inputs) and the backward recomputes one segment at a time. The
trainable parameters of a segment's layers are explicit inputs of its
checkpointed function, as in mlx-lm's `grad_checkpoint`, so their gradients
flow; everything else is frozen.
"""

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .attention import PackedMask, causal_mask
from .caches import PackedCache, PrefixCache, RecordCache


def positions(h, offset, packed):
    """The layers' `offset`: per-row positions of a packed prefix batch (`packed`:
    its prompt length), else the stack's offset."""
    return mx.array([0] + [packed] * (h.shape[0] - 1)) if packed else offset


def layer_mask(n, offset, packed, window):
    """The mask of `n` queries for layers with this window."""
    return PackedMask(packed, window) if packed else causal_mask(n, offset, window)


def layer_cache(lm, i, at, packed, prompt, keep_kv):
    """Layer i's cache: None where it computes no keys/values of its own or there
    is nothing to keep; `prompt` its prompt (keys, values) for a continuation."""
    if not lm.has_cache(i):
        return None
    if packed:
        return PackedCache(at)
    if prompt is not None:
        return PrefixCache(*prompt)
    return RecordCache() if keep_kv else None


def _body(lm, lo, hi, offset, keep_kv, packed, masks):
    """The plain function of layers [lo, hi): (h, aux, prompt_kv, shared) ->
    (h, recorded kv per cached layer, shared kv produced here). With `packed`
    (a prompt length) the rows are a packed prefix batch (see `prefix`).
    `masks` (window -> mask) is shared by every segment of a stack and its
    recomputation, so each mask is built once per stack, not per layer call."""

    def run(h, aux, prompt_kv, shared_in):
        n = h.shape[1]
        shared = dict(shared_in)
        produced, recorded = {}, []
        cached = [i for i in range(lo, hi) if lm.has_cache(i)]
        at = positions(h, offset, packed)
        for i in range(lo, hi):
            w = lm.windows[i]
            if w not in masks:
                masks[w] = layer_mask(n, offset, packed, w)
            prompt = prompt_kv[cached.index(i)] if prompt_kv and lm.has_cache(i) else None
            cache = layer_cache(lm, i, at, packed, prompt, keep_kv)
            src = lm.sources[i]
            h, kv = lm.layer(
                i, h, masks[w], cache,
                aux[:, :, i - lo] if isinstance(aux, mx.array) else None,
                shared.get(str(src)) if src is not None else None, at,
            )
            if cache is not None and keep_kv:
                recorded.append(cache.kv)
            if kv is not None and i in lm.sources:
                shared[str(i)] = tuple(kv)
                # An array returned twice by a checkpointed function loses one of
                # its cotangents: a recorded kv is not returned again as shared.
                if not (cache is not None and keep_kv):
                    produced[str(i)] = shared[str(i)]
        return h, recorded, produced

    return run


def _arrays(tree):
    return [x for _, x in tree_flatten(tree) if isinstance(x, mx.array)]


def _as_list(x):
    return [x] if isinstance(x, mx.array) else list(x)


def _refill(tree, arrays):
    it = iter(arrays)
    return tree_map(lambda x: next(it) if isinstance(x, mx.array) else x, tree)


def checkpoint(fn):
    """`mx.checkpoint(fn)` for `fn(params, *inputs)`, with the backward ordered so
    that one segment's recomputed activations are alive at a time.

    `mx.checkpoint`'s recomputation waits only for the forward's outputs, so the
    scheduler may recompute several segments before their cotangents exist, and
    a segment's weight gradients may wait while the next segment runs. Here the
    recomputation waits for the output cotangents, and the input cotangents (what
    the segment before needs) wait for this segment's parameter gradients.
    """

    def call(params, *inputs):
        # A copy of the containers: the caller may add to them (shared kv) later.
        tree = tree_map(lambda x: x, (params, inputs))
        n_params = len(_arrays(params))
        out_tree = {}

        def flat(*xs):
            p, ins = _refill(tree, xs)
            out = fn(p, *ins)
            out_tree["out"] = out
            return _arrays(out)

        f = mx.custom_function(flat)

        @f.vjp
        def backward(primals, cotangents, outputs):
            single = isinstance(primals, mx.array)  # one input: an array, not a list
            cotangents = _as_list(cotangents)
            xs = mx.depends(_as_list(primals), cotangents)
            _, grads = mx.vjp(flat, xs, cotangents)
            pg, ig = list(grads[:n_params]), list(grads[n_params:])
            if pg and ig:
                ig = mx.depends(ig, pg)
            return grads[0] if single else tuple(pg + ig)

        outs = f(*_arrays(tree))
        return _refill(out_tree["out"], outs)

    return call


def _checkpointed(lm, lo, hi, run):
    layers = lm.layers[lo:hi]

    def fn(params, h, aux, prompt_kv, shared_in):
        for layer, p in zip(layers, params):
            layer.update(p)
        return run(h, aux, prompt_kv, shared_in)

    ckpt = checkpoint(fn)

    def call(h, aux, prompt_kv, shared_in):
        params = [layer.trainable_parameters() for layer in layers]
        return ckpt(params, h, aux, prompt_kv, shared_in)

    return call


def run_stack(
    lm, h, aux=None, *, offset=0, prompt_kv=None, keep_kv=False, packed=None, segment_size=0
):
    """Runs every layer of `lm` on `h` `[B, L, d]` at positions offset..offset+L.

    `aux` is Gemma 4's per-layer input `[B, L, layers, d']`. With `prompt_kv`
    (one (k, v) per cached layer, from a `keep_kv` run over the prompt) the tokens
    continue that prompt. Returns `(h, kv)`: the last hidden states (before the
    final norm) and, with `keep_kv`, the (k, v) of every cached layer.
    `packed` (a prompt length): `h` is a packed prefix batch (see `prefix`).
    """
    n = len(lm.layers)
    k = n if not segment_size else segment_size
    shared, kv_out, kv_in, masks = {}, [], list(prompt_kv or []), {}
    for lo in range(0, n, k):
        hi = min(n, lo + k)
        n_cached = sum(lm.has_cache(i) for i in range(lo, hi))
        seg_kv, kv_in = kv_in[:n_cached], kv_in[n_cached:]
        seg_aux = [] if aux is None else aux[:, :, lo:hi]
        run = _body(lm, lo, hi, offset, keep_kv, packed, masks)
        if segment_size:
            run = _checkpointed(lm, lo, hi, run)
        h, recorded, produced = run(h, seg_aux, seg_kv, shared)
        shared.update(produced)
        cached = [i for i in range(lo, hi) if lm.has_cache(i)]
        for i, kv in zip(cached, recorded):
            if i in lm.sources:
                shared[str(i)] = kv
        kv_out.extend(recorded)
    return h, kv_out
