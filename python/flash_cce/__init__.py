"""mlx-flash-cce: a fused linear cross-entropy head and preference fine-tuning for MLX."""

from .ops import flash_cce_backward, flash_cce_forward, has_native_kernel
from .head import linear_cross_entropy, linear_logprobs, unpack_head
from .metal import metal_status

__all__ = [
    "flash_cce_forward",
    "flash_cce_backward",
    "has_native_kernel",
    "metal_status",
    "linear_logprobs",
    "linear_cross_entropy",
    "unpack_head",
]
__version__ = "0.1.0"
