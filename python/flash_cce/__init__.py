"""mlx-flash-cce: a fused linear cross-entropy head and preference fine-tuning for MLX.

The head's API below loads on first use, so that `flash-cce` (flash_cce.train.cli)
can set MLX's environment before MLX is imported.
"""

from ._lazy import attributes

_API = {
    "flash_cce_forward": "ops",
    "flash_cce_backward": "ops",
    "has_native_kernel": "ops",
    "metal_status": "metal",
    "linear_logprobs": "head",
    "linear_cross_entropy": "head",
    "unpack_head": "head",
    "TokenStats": "ops",
}
__all__ = list(_API)
__version__ = "0.1.0"
__getattr__, __dir__ = attributes(__name__, _API)
