// Replaces MLX's bf16_math.h, which forwards bfloat math to Apple's internal
// __metal_* builtins: the emulation's metal:: functions take bfloat directly.
#pragma once
