"""The KV caches the decoder stack passes to mlx-lm's attention layers.

They speak mlx-lm's cache protocol (`offset`, `update_and_fetch`) but are
functional: they return the keys/values to attend to instead of writing into a
buffer, so gradients flow through them. `segmented.layer_cache` picks one per
layer for the layouts of `prefix`.
"""

import mlx.core as mx


class RecordCache:
    """Cache for a forward from position 0 that keeps the keys/values it sees."""

    offset = 0

    def __init__(self):
        self.kv = None

    def update_and_fetch(self, keys, values):
        self.kv = (keys, values)
        return keys, values


class PrefixCache:
    """Cache holding a prompt's keys/values `[1, heads, P, d]` for a continuation."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]

    def update_and_fetch(self, keys, values):
        def join(prompt, new):
            prompt = mx.broadcast_to(prompt, (new.shape[0],) + prompt.shape[1:])
            return mx.concatenate([prompt, new], axis=2)

        return join(self.keys, keys), join(self.values, values)


class PackedCache:
    """Cache of a packed prefix batch: per-row positions, keys/values as they are."""

    def __init__(self, offsets):
        self.offset = offsets

    def update_and_fetch(self, keys, values):
        return keys, values
