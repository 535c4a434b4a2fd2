"""The head API needs only MLX and numpy: `import flash_cce` and a head call work
with the training dependencies (mlx-lm, pyyaml, tqdm, tokenizers, transformers)
unimportable, as in an install without the `train` extra."""

import subprocess
import sys
import textwrap

BLOCKED = ("mlx_lm", "yaml", "tqdm", "tokenizers", "transformers")

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = {blocked!r}

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked")
            return None

    sys.meta_path.insert(0, Block())
    for name in BLOCKED:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker let {{name}} through")

    import numpy as np
    import mlx.core as mx
    import flash_cce as fc

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    M, H, V = 6, 32, 50
    h = rng.standard_normal((M, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / np.sqrt(H)).astype(np.float32)
    y = rng.integers(0, V, M)

    logp = np.array(fc.linear_logprobs(mx.array(h), mx.array(w), mx.array(y)))
    loss = fc.linear_cross_entropy(mx.array(h), mx.array(w), mx.array(y), reduction="sum").item()

    s = h.astype(np.float64) @ w.astype(np.float64).T
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    ref = s[np.arange(M), y] - lse
    # The bound of test_head.py: a logit errs by at most (H + 2) u sum|h_k w_k|
    # (u = 2^-24), and logp by twice that plus (V + 16) u (1 + |lse|).
    u = 2.0 ** -24
    ds = (H + 2) * u * (np.abs(h) @ np.abs(w).T).max(1)
    bound = 2 * ds + (V + 16) * u * (1 + np.abs(lse))
    err = np.abs(logp - ref)
    assert (err <= bound).all(), (err, bound)
    assert abs(loss + ref.sum()) <= bound.sum(), (loss, -ref.sum())
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("ok")
    """
)


def test_head_imports_without_training_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
