"""Smoke test of an installed flash_cce, run from outside the source tree.

The native CPU kernel's log-probabilities against log_softmax of the full
logits in float64 (numpy), its gradient against central differences of the
same, the `flash-cce` console script and a two-step demo.
"""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import flash_cce as fc
from flash_cce import _ext

here = Path.cwd().resolve()
assert not (here / "pyproject.toml").exists(), "run this outside the source tree"
print("flash_cce from", Path(fc.__file__).parent, "- GEMM kernel:", _ext.cpu_gemm_kernel())

mx.set_default_device(mx.cpu)
M, H, V = 12, 40, 300
h = mx.random.normal((M, H), key=mx.random.key(1))
w = 0.3 * mx.random.normal((V, H), key=mx.random.key(2))
y = mx.random.randint(0, V, (M,), key=mx.random.key(3)).astype(mx.int32)
logp = fc.linear_logprobs(h, w, y, backend="native")

h64, w64, y64 = (np.array(a, dtype=np.float64) for a in (h, w, y))
s = h64 @ w64.T
ref = s[np.arange(M), y64.astype(int)] - (s.max(1) + np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)))
# fp32 logits over H = 40 terms of size ~1: a few 1e-6 absolute.
assert np.allclose(np.array(logp), ref, atol=1e-4), np.abs(np.array(logp) - ref).max()

g = mx.grad(lambda x: fc.linear_logprobs(x, w, y, backend="native").sum())(h)
eps, (i, j) = 1e-4, (3, 7)
hp, hm = h64.copy(), h64.copy()
hp[i, j] += eps
hm[i, j] -= eps
f = lambda x: ((x @ w64.T)[np.arange(M), y64.astype(int)] - np.log(np.exp(x @ w64.T).sum(1))).sum()
fd = (f(hp) - f(hm)) / (2 * eps)
assert abs(float(g[i, j]) - fd) < 1e-3, (float(g[i, j]), fd)

# The console script the package installs beside the interpreter, and the demo
# (its bundled data is package data of flash_cce.train).
script = str(Path(sys.executable).parent / "flash-cce")
cli = subprocess.run([script, "--help"], capture_output=True, text=True)
assert cli.returncode == 0 and "usage" in cli.stdout.lower(), cli.stderr[-2000:]
demo = subprocess.run([script, "demo", "--iters", "2", "--run-dir", str(here / "smoke-demo")],
                      capture_output=True, text=True)
assert demo.returncode == 0 and (here / "smoke-demo" / "metrics.jsonl").exists(), demo.stderr[-2000:]
print("smoke test: ok")
