"""The compiled layers' kernels, built by a second process while a run starts
without them.

On a CUDA GPU, MLX builds the fused kernels of `stack.compiled`'s layers with
NVRTC the first time a machine runs them, seconds each, one after the other: at
the lengths whose steps take the compiled layers by default
(`plan.COMPILED_FROM_TOKENS`) a model's first step would take a minute or more.
MLX keeps what it builds in a cache on disk (`MLX_PTX_CACHE_DIR`, by default
under the temporary directory) that later processes read. So a run whose
settings leave the choice to the default starts a helper (`warmup_step`) on its
own settings, once its first step (uncompiled) has shown how much GPU memory a step
takes and if that much is free: one training step with the compiled layers on,
in a scratch run directory, its kernels written to a private cache directory.
Meanwhile the run's steps take the layers uncompiled
(`StackConfig.compiled_when`); without the room, or if the helper fails, the
run builds them itself, as it would without a helper. When the helper has
finished, its kernels move into MLX's cache, each file by a rename (a module's
.ptx, the file MLX looks for, last), and the next step takes the compiled
layers, reading them from there. A marker in the cache, named after what the
kernels depend on (MLX's version, the model, the adapters, the stack's
settings), lets a later run with the same start compiled at once. The helper
runs its step on the first batch: kernels of a prompt layout that batch does
not have (`prefix`) are built by the run when it meets one.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .rundir import pid_alive

# The settings the compiled layers' kernels depend on: the layers' graph and
# dtypes (the model, its quantization and adapters) and how the stack lays out
# and runs a step.
SHAPING = ("model", "fine_tune_type", "num_layers", "lora_parameters", "quantize", "objective",
           "prefix_sharing", "flash_head", "segment_size", "pad_to", "attention_block")

# GPU memory a helper needs, in units of the run's first step's peak scaled to
# the run's largest batch: its step is such a step with the compiled layers (6%
# more at model B 8k), and a margin.
ROOM = 1.25
GB = 1e9  # as the trainer reports memory


def kernel_cache():
    """MLX's CUDA kernel cache, as MLX picks it."""
    import mlx.core as mx

    given = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def key(cfg):
    """The name of the marker of `cfg`'s compiled-layer kernels."""
    import mlx.core as mx

    shaping = [mx.__version__] + [cfg.get(k) for k in SHAPING]
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:20]


def tokens(example):
    """Tokens of a pair as the stack's plan counts them (an unpaired example: as its pair)."""
    pair = example.as_pair() if hasattr(example, "as_pair") else example
    return len(pair.chosen) + len(pair.rejected)


def wanted(cfg, examples, ranks):
    """Whether a run of `cfg` on `examples` (its training split) starts a helper:
    the default picks the compiled layers (`plan`) for some example, on a CUDA
    GPU, in a single process (the ranks of a distributed run would each build
    the same kernels)."""
    from ..stack.plan import COMPILED_FROM_TOKENS, on_cuda

    return (cfg["compiled_layers"] == "auto" and ranks == 1 and on_cuda()
            and any(tokens(e) >= COMPILED_FROM_TOKENS for e in examples))


def free_gpu_memory():
    """Bytes of GPU memory another process could take (None: MLX does not
    say). Memory in MLX's cache counts as taken: the run reuses it."""
    import mlx.core as mx

    info = mx.device_info()
    if "free_memory" in info:
        return info["free_memory"]
    if "total_memory" in info:
        return info["total_memory"] - mx.get_active_memory() - mx.get_cache_memory()
    return None


def publish(private, cache):
    """Moves the files under `private` (a directory inside `cache`: one file
    system) into `cache`, same relative paths, each by one rename, every .ptx
    after the other files; returns how many .ptx files moved."""
    files = sorted((p for p in private.rglob("*") if p.is_file()), key=lambda p: p.suffix == ".ptx")
    for f in files:
        dest = cache / f.relative_to(private)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest)
    return sum(f.suffix == ".ptx" for f in files)


def sweep(parent):
    """Removes the scratch directories of runs that are gone (killed before they
    could remove them; their helpers died with them)."""
    for d in parent.glob("warmup-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


class Warmup:
    """A run's helper (see the module). `start()` (entering it): looks for the
    marker; `after_step(record)` (the trainer's `on_step`): after the first
    step, starts the helper if there is room; `ready()`: whether the compiled
    layers may run (asked at each new step shape: it notices the helper's end,
    publishes its kernels and says so in one line); `close()`: stops a helper
    still running and removes its scratch directory. `command`: the helper's
    command line (tests), by default `warmup_step` on the settings."""

    def __init__(self, cfg, log, command=None, largest_tokens=None):
        # largest_tokens: tokens of the run's largest micro-batch (None: as its first).
        self.cfg, self.log, self.command, self.largest = cfg, log, command, largest_tokens
        self.cache = kernel_cache()
        self.home = self.cache / "flash-cce"  # markers and scratch directories
        self.marker = self.home / f"{key(cfg)}.done"
        self.proc = self.scratch = None
        self.state, self.tic = "idle", 0.0

    def start(self):
        """Ready at once where the marker says the kernels are cached, else
        waiting for the first step."""
        self.state = "ready" if self.marker.exists() else "waiting"
        return self

    def after_step(self, record):
        if self.state != "waiting":
            return
        first = record["tokens"] / self.cfg.get("grad_accumulation_steps", 1)
        scale = max(1.0, self.largest / first) if self.largest and first else 1.0
        need, free = ROOM * record["peak_memory_gb"] * GB * scale, free_gpu_memory()
        if free is not None and free < need:
            self.state = "ready"
            self.log(f"Compiled layers: a second process to build their kernels would need about "
                     f"{need / GB:.1f} GB of GPU memory, {free / GB:.1f} GB are free; "
                     "the run builds them itself")
            return
        self.launch()

    def launch(self):
        """Starts the helper; where it cannot start (a cache that cannot be
        written, no process), the run compiles the layers itself."""
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            sweep(self.home)
            self.scratch = Path(tempfile.mkdtemp(prefix=f"warmup-{os.getpid()}-", dir=self.home))
            spec = self.scratch / "settings.json"
            spec.write_text(json.dumps(self.cfg, default=str))
            command = self.command or [sys.executable, "-m", "flash_cce.train.warmup_step", str(spec),
                                       str(os.getpid())]
            env = dict(os.environ, MLX_PTX_CACHE_DIR=str(self.scratch / "ptx"))
            with open(self.scratch / "warmup.log", "w") as out:
                # A session of its own: the terminal's Ctrl-C reaches the run, which stops it.
                self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self.log(f"Compiled layers: could not start a second process to build their kernels ({e}); "
                     "the run builds them itself")
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
            self.state = "ready"
            return self
        self.state, self.tic = "running", time.perf_counter()
        self.log(f"Compiled layers: MLX builds their kernels in a second process (pid {self.proc.pid}); "
                 "until it is done the steps run the layers uncompiled")
        return self

    def ready(self):
        if self.state == "running":
            code = self.proc.poll()
            if code is not None:
                self._finish(code)
        return self.state in ("ready", "failed")

    def _finish(self, code):
        # Whatever happened, the compiled layers run from now on: built by the
        # helper, or else by the run itself as without one.
        took = time.perf_counter() - self.tic
        if code != 0:
            self.state = "failed"  # ready, keeping the helper's log
            self.log(f"Compiled layers: the second process failed (exit code {code}; its output: "
                     f"{self._keep_log()}); the run builds their kernels itself")
            return
        self.state = "ready"
        try:
            if publish(self.scratch / "ptx", self.cache):
                self.marker.touch()
        except OSError as e:
            self.log(f"Compiled layers: could not move their kernels into {self.cache} ({e}); "
                     "the run builds them itself")
        else:
            self.log(f"Compiled layers: kernels ready after {took:.0f} s; the steps run them from now on")
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _keep_log(self):
        # The helper's output for the user; its run directory and kernels go.
        log = self.scratch / "warmup.log"
        for p in self.scratch.iterdir():
            if p != log:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return log

    def close(self):
        self.ready()  # a helper that has finished still publishes its kernels
        if self.state == "running":  # its kernels are incomplete: nothing to keep
            self.proc.kill()
            self.proc.wait()
            self.state = "stopped"
        if self.scratch is not None and self.state != "failed":
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
