"""Whether the native Metal kernels run: a load check and a one-time self-check.

The Metal kernels were verified by emulation on a CPU, never on an Apple GPU.
So before the first native call in a process for a head configuration (dtypes,
bit width, group size) the kernels' library must load, and the kernels must
agree with the pure-MLX fallback on a few small problems within derived bounds
(selfcheck.py). Otherwise the head warns once, saying why and what to report,
and uses the fallback for that configuration: slower, never wrong.
`backend="native"` / `"fallback"` skip the check either way.
"""

import threading
import warnings

import mlx.core as mx

from . import _ext
from .selfcheck import PROBLEMS, HeadSpec, self_check

REPORT = (
    "Please report it on the project's issue tracker with the output of\n"
    '  python -c "import flash_cce; print(flash_cce.metal_status())"\n'
    "and of `sw_vers; sysctl -n machdep.cpu.brand_string; "
    "pip show mlx mlx-metal mlx-flash-cce`."
)


class FlashCCEMetalWarning(RuntimeWarning):
    """The Metal kernels are not used for a configuration; the fallback is."""


def _library_from_ext():
    kind, path, error = _ext.metal_library()
    return {"source": kind or None, "path": path or None, "error": error or None}


class Gate:
    """Decides, once per head configuration, whether the native kernels run.

    load_library() -> {"source", "path", "error"}; native: an object with
    forward/backward like flash_cce._ext; stream: where the self-check runs
    (None: a new stream on the GPU, so that a kernel fault cannot poison the
    caller's stream); problems: the self-check's (selfcheck.PROBLEMS).
    """

    def __init__(self, load_library=_library_from_ext, native=_ext, stream=None,
                 warn=None, problems=PROBLEMS):
        self._load_library = load_library
        self._native = native
        self._stream = stream
        self._problems = problems
        self._warn = warn or (lambda msg: warnings.warn(msg, FlashCCEMetalWarning, stacklevel=4))
        self._lock = threading.RLock()
        self.library = None
        self.checks = {}  # HeadSpec.key -> CheckResult
        self.last_error = None
        self._warned = set()

    def _warn_once(self, key, reason):
        if key not in self._warned:
            self._warned.add(key)
            self._warn(f"[flash_cce] {reason}\nUsing the pure-MLX fallback instead "
                       f"(correct, slower).\n{REPORT}")

    def library_status(self):
        with self._lock:
            if self.library is None:
                try:
                    self.library = dict(self._load_library())
                except Exception as err:  # noqa: BLE001 - a broken loader is a failed load
                    self.library = {"source": None, "path": None, "error": str(err)}
                if self.library.get("error") and not self.library.get("source"):
                    self.last_error = self.library["error"]
            return self.library

    def allows(self, spec, entropy=False):
        """True when the native kernels may run for `spec` (a HeadSpec); with
        `entropy`, also their entropy variants, checked apart the first time a
        call asks for them (calls without the entropy never pay for it)."""
        with self._lock:
            lib = self.library_status()
            if not lib.get("source"):
                self._warn_once("library", "the Metal kernels could not be loaded: "
                                f"{lib.get('error')}")
                return False
            return self._passes(spec, False) and (not entropy or self._passes(spec, True))

    def _passes(self, spec, entropy):
        key = spec.key + (", entropy" if entropy else "")
        result = self.checks.get(key)
        if result is None:
            if self._stream is None:
                self._stream = mx.new_stream(mx.gpu)
            result = self.checks[key] = self_check(spec, self._native, self._stream,
                                                   self._problems, entropy=entropy)
            if not result.passed:
                self.last_error = f"{key}: {result.detail}"
        if not result.passed:
            self._warn_once(key, f"the Metal kernels failed their self-check for {key}: "
                            f"{result.detail}")
        return result.passed


GATE = Gate()

# The configurations metal_status() checks when asked to (the common heads).
COMMON_SPECS = (
    HeadSpec("float32", "float32"),
    HeadSpec("bfloat16", "bfloat16"),
    HeadSpec("float16", "float16"),
    HeadSpec("bfloat16", "uint32", 4, 64, "bfloat16"),
    HeadSpec("bfloat16", "uint32", 8, 64, "bfloat16"),
)


# The kernels index [M, H] arrays with 32-bit ints (csrc/metal/plan.cpp).
MAX_ELEMENTS = 2**31 - 1


def fits(h):
    """Whether the Metal kernels take an `h` of this size (else the fallback runs)."""
    return h is None or h.size <= MAX_ELEMENTS


def gated(device):
    """Whether calls on `device` go through GATE (the GPU of a Metal build)."""
    return device.type == mx.gpu and _ext.has_metal_kernels()


class MetalStatus(dict):
    """metal_status()'s answer: a dict that prints as a short report."""

    def __str__(self):
        lines = [f"{k}: {v}" for k, v in self.items() if k not in ("configs", "compiled")]
        comp = self["compiled"]
        lines.append(f"compiled: {len(comp)} libraries from source"
                     + "".join(f"\n  {c['seconds']:.2f} s, {c['source_bytes']} bytes: "
                               f"{', '.join(c['kernels'])}" for c in comp))
        lines.append("configs:" + ("" if self["configs"] else " none checked yet"))
        for key, c in self["configs"].items():
            state = "native" if c["passed"] else "fallback"
            lines.append(f"  {key}: {state} ({c['detail']})")
        return "\n".join(lines)


def compiled_libraries():
    """The Metal libraries compiled from source in this process, one per
    launch plan's kernel set: kernels, source bytes, seconds."""
    return [{"kernels": list(k), "source_bytes": int(b), "seconds": float(s)}
            for k, b, s in _ext.metal_compiled()]


def metal_status(check=True, gate=None):
    """What runs the head on this Mac's GPU, and why.

    With `check`, loads the kernels' library and self-checks COMMON_SPECS
    (a second or so) where the Metal kernels are built and a GPU exists.
    Returns a MetalStatus (a dict): whether Metal is available and the kernels
    built, where the library came from ("metallib" or "source", compiled at
    run time per launch plan's kernels), the libraries compiled so far (their
    kernels, source size and compile seconds), each checked configuration's
    result, and the last error.
    """
    gate = gate or GATE
    available = bool(mx.metal.is_available())
    built = bool(_ext.has_metal_kernels())
    if check and available and built:
        for spec in COMMON_SPECS:
            gate.allows(spec, entropy=True)
    lib = gate.library or {}
    if not built:
        active = "fallback (this build has no Metal kernels)"
    elif not available:
        active = "fallback (no Metal GPU)"
    elif gate.library is None:
        active = "not decided yet (no head call on the GPU so far)"
    elif not lib.get("source"):
        active = "fallback (the kernels' library did not load)"
    else:
        passed = [k for k, c in gate.checks.items() if c.passed]
        active = f"native for {len(passed)} of {len(gate.checks)} checked configurations"
    return MetalStatus(
        metal_available=available,
        kernels_built=built,
        active=active,
        library_source=lib.get("source"),
        library_path=lib.get("path"),
        library_error=lib.get("error"),
        compiled=compiled_libraries(),
        configs={k: {"passed": c.passed, "worst_error_over_bound": c.worst,
                     "detail": c.detail} for k, c in gate.checks.items()},
        last_error=gate.last_error,
    )
