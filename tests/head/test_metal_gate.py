"""The Metal safety gate (metal.py, selfcheck.py), driven on the CPU.

The gate's native path is injected: the CPU kernels (correct), the CPU kernels
with one defect each (a lost vocabulary tile, a lost gradient row, NaN, an
exception at launch), or a library that fails to load. The check must pass the
correct kernels for every dtype and bit width and refuse each defect; the op
must then warn once and return the fallback's results.
"""

import warnings

import mlx.core as mx
import numpy as np
import pytest

import flash_cce as fc
from flash_cce import _ext, fallback, metal, ops
from flash_cce.selfcheck import PROBLEMS, HeadSpec, self_check

# The shipped problems' first three (the small ones) keep this file fast; the
# whole list runs once for a dense and a quantized head.
SMALL = PROBLEMS[:3]
LIB_OK = {"source": "source", "path": None, "error": None}

SPECS = [
    HeadSpec("float32", "float32"),
    HeadSpec("bfloat16", "bfloat16"),
    HeadSpec("float16", "float16"),
    HeadSpec("float32", "bfloat16"),
    HeadSpec("bfloat16", "uint32", 4, 64, "bfloat16"),
    HeadSpec("float16", "uint32", 8, 32, "float16"),
    HeadSpec("float32", "uint32", 3, 128, "float32"),
    HeadSpec("bfloat16", "uint32", 2, 32, "bfloat16"),
    HeadSpec("bfloat16", "uint32", 5, 64, "bfloat16"),
    HeadSpec("bfloat16", "uint32", 6, 128, "bfloat16"),
]


class Native:
    """_ext on the CPU, with an optional defect in one output."""

    def __init__(self, defect=None, only_quantized=False):
        self.defect, self.only_quantized = defect, only_quantized
        self.calls = 0

    def _on(self, scales):
        return self.defect and not (self.only_quantized and scales is None)

    @staticmethod
    def supports_stats(device):
        return _ext.supports_stats(device)

    def forward(self, h, w, targets, scales=None, biases=None, **kw):
        self.calls += 1
        if self._on(scales) and self.defect == "raise":
            raise RuntimeError("[metal::Device] Unable to load kernel flash_cce_fwd")
        if self._on(scales) and self.defect == "lost_tile":
            # The last 32 vocabulary rows never reach the logsumexp.
            logp, lse = _ext.forward(h, w, targets, scales, biases, **kw)
            cut = [None if a is None else a[:-32] for a in (w, scales, biases)]
            _, lse_cut = _ext.forward(h, cut[0], mx.zeros_like(targets), cut[1], cut[2], **kw)
            return [logp + lse - lse_cut, lse_cut]
        out = _ext.forward(h, w, targets, scales, biases, **kw)
        if self._on(scales) and self.defect == "nan":
            out = [mx.where(mx.arange(out[0].size) == 0, float("nan"), out[0]), out[1]]
        return out

    def backward(self, *args, **kw):
        out = _ext.backward(*args, **kw)
        if self._on(args[6]) and self.defect == "dh_row":
            # The last row tile's gradient is never written.
            dh = out[0]
            out = [mx.where(mx.arange(dh.shape[0])[:, None] == dh.shape[0] - 1, 0, dh)] + list(out[1:])
        return out


def gate(native=None, library=LIB_OK, log=None):
    log = [] if log is None else log
    return metal.Gate(load_library=lambda: library, native=native or Native(),
                      stream=mx.cpu, warn=log.append, problems=SMALL), log


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key)
def test_correct_kernels_pass_every_config(spec):
    result = self_check(spec, Native(), mx.cpu, SMALL)
    assert result.passed, result.detail
    assert 0 <= result.worst <= 1


@pytest.mark.parametrize("spec", [SPECS[1], SPECS[4]], ids=lambda s: s.key)
def test_correct_kernels_pass_the_shipped_problems(spec):
    result = self_check(spec, Native(), mx.cpu)
    assert result.passed, result.detail


@pytest.mark.parametrize("defect", ["lost_tile", "dh_row", "nan", "raise"])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[4]], ids=lambda s: s.key)
def test_each_defect_fails_the_check(spec, defect):
    result = self_check(spec, Native(defect), mx.cpu, SMALL)
    assert not result.passed
    assert result.worst > 1
    assert result.detail


def test_gate_warns_once_per_config_and_keeps_the_result():
    native = Native("dh_row", only_quantized=True)
    g, log = gate(native)
    dense, quant = SPECS[1], SPECS[4]
    assert g.allows(dense)
    assert not g.allows(quant) and not g.allows(quant)
    assert len(log) == 1
    assert quant.key in log[0] and "dh(" in log[0]
    assert "metal_status()" in log[0] and "fallback" in log[0]
    calls = native.calls
    g.allows(dense), g.allows(quant)
    assert native.calls == calls  # checked once per process and configuration
    assert g.checks[dense.key].passed and not g.checks[quant.key].passed
    assert g.last_error.startswith(quant.key)


def test_library_failure_warns_once_and_never_runs_native():
    native = Native()
    lib = {"source": None, "path": None,
           "error": "[metal::Device] Unable to build metal library from source"}
    g, log = gate(native, lib)
    assert not g.allows(SPECS[0]) and not g.allows(SPECS[4])
    assert len(log) == 1 and "could not be loaded" in log[0] and "Unable to build" in log[0]
    assert native.calls == 0
    assert g.last_error == lib["error"]


def test_a_raising_loader_counts_as_a_failed_load():
    def boom():
        raise RuntimeError("no device")

    g = metal.Gate(load_library=boom, native=Native(), stream=mx.cpu, warn=lambda m: None,
                   problems=SMALL)
    assert not g.allows(SPECS[0])
    assert g.library["error"] == "no device"


@pytest.fixture
def cpu_gated(monkeypatch):
    """Route CPU calls of the ops through a test gate, as a Metal GPU's are."""

    def install(native=None, library=LIB_OK):
        g, log = gate(native, library)
        monkeypatch.setattr(metal, "GATE", g)
        monkeypatch.setattr(metal, "gated", lambda device: device.type == mx.cpu)
        return g, log

    return install


def _problem(quantized):
    rng = np.random.default_rng(7)
    h = mx.array(rng.standard_normal((9, 128)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((200, 128)).astype(np.float32) / 8).astype(mx.bfloat16)
    y = mx.array(rng.integers(0, 200, 9).astype(np.int32))
    if not quantized:
        return h, w, y, {}
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    return h, q, y, {"scales": s, "biases": b, "group_size": 64}


@pytest.mark.parametrize("quantized", [False, True])
def test_op_uses_the_fallback_after_a_failed_check(cpu_gated, quantized):
    g, log = cpu_gated(Native("lost_tile"))
    h, w, y, q = _problem(quantized)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the test gate logs instead of warning
        logp, lse = fc.flash_cce_forward(h, w, y, stream=mx.cpu, **q)
        logp2, _ = fc.flash_cce_forward(h, w, y, stream=mx.cpu, **q)
    with mx.stream(mx.cpu):
        want = fallback.forward(h, w, y, q.get("scales"), q.get("biases"),
                                group_size=64, bits=4 if quantized else None)
    assert np.array_equal(np.array(logp), np.array(want[0]))
    assert np.array_equal(np.array(lse), np.array(want[1]))
    assert np.array_equal(np.array(logp2), np.array(want[0]))
    assert len(log) == 1
    dh = fc.flash_cce_backward(h, w, y, lse, mx.ones(y.shape), stream=mx.cpu, **q)
    assert dh.shape == h.shape and len(log) == 1


def test_op_runs_native_after_a_passed_check(cpu_gated, monkeypatch):
    g, log = cpu_gated(Native())
    h, w, y, q = _problem(False)
    assert g.allows(HeadSpec.of(h, w))  # the self-check uses the fallback itself
    calls = []
    monkeypatch.setattr(ops.fallback, "forward", lambda *a, **k: calls.append(1))
    logp, lse = fc.flash_cce_forward(h, w, y, stream=mx.cpu)
    want = _ext.forward(h, w, y, stream=mx.cpu)
    assert np.array_equal(np.array(logp), np.array(want[0])) and not calls and not log
    assert g.checks[HeadSpec.of(h, w).key].passed


def test_explicit_backends_skip_the_gate(cpu_gated):
    native = Native("lost_tile")
    g, log = cpu_gated(native)
    h, w, y, _ = _problem(False)
    logp, _ = fc.flash_cce_forward(h, w, y, stream=mx.cpu, backend="native")
    assert np.array_equal(np.array(logp), np.array(_ext.forward(h, w, y, stream=mx.cpu)[0]))
    fc.flash_cce_forward(h, w, y, stream=mx.cpu, backend="fallback")
    assert native.calls == 0 and not g.checks and not log


def test_metal_status_reports_checks_and_errors(monkeypatch):
    g, _ = gate(Native("dh_row", only_quantized=True))
    monkeypatch.setattr(metal.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(metal._ext, "has_metal_kernels", lambda: True)
    st = metal.metal_status(gate=g)
    assert st["metal_available"] and st["kernels_built"]
    assert st["library_source"] == "source"
    # Each configuration and its entropy check (run where the logp check passed).
    dense = {s.key for s in metal.COMMON_SPECS if s.bits is None}
    ent = {k + ", entropy" for k in dense}
    assert set(st["configs"]) == {s.key for s in metal.COMMON_SPECS} | ent
    passed = {k for k, c in st["configs"].items() if c["passed"]}
    assert passed == dense | ent
    assert st["active"] == f"native for {len(passed)} of {len(st['configs'])} checked configurations"
    assert "-bit/64 (bfloat16 scales): dh(" in st["last_error"]
    text = str(st)
    assert "configs:" in text and ": fallback (" in text and ": native (" in text


def test_metal_status_reports_compiled_libraries(monkeypatch):
    # One library per launch plan's kernel set, as the Metal host records them.
    libs = [(["fcce_combine", "fcce_fwd_hbf16_wbf16"], 61234, 0.42),
            (["fcce_dh_hbf16_wbf16", "fcce_reduce_dh_bf16"], 60001, 0.38)]
    monkeypatch.setattr(metal._ext, "metal_compiled", lambda: libs)
    st = metal.metal_status(check=False, gate=gate()[0])
    assert [c["kernels"] for c in st["compiled"]] == [k for k, _, _ in libs]
    assert [c["seconds"] for c in st["compiled"]] == [0.42, 0.38]
    assert [c["source_bytes"] for c in st["compiled"]] == [61234, 60001]
    text = str(st)
    assert "compiled: 2 libraries from source" in text and "0.42 s, 61234 bytes" in text


def test_metal_status_without_metal():
    st = fc.metal_status()
    assert st["kernels_built"] == _ext.has_metal_kernels()
    if not _ext.has_metal_kernels():
        assert st["active"] == "fallback (this build has no Metal kernels)"
        assert st["configs"] == {}
        assert _ext.metal_library() == ("", "", "this build has no Metal kernels")
    assert "configs:" in str(st)


def test_sizes_beyond_the_kernels_indexing_use_the_fallback(cpu_gated, monkeypatch):
    native = Native()
    g, log = cpu_gated(native)
    h, w, y, _ = _problem(False)
    monkeypatch.setattr(metal, "MAX_ELEMENTS", h.size - 1)
    logp, _ = fc.flash_cce_forward(h, w, y, stream=mx.cpu)
    with mx.stream(mx.cpu):
        want, _ = fallback.forward(h, w, y)
    assert np.array_equal(np.array(logp), np.array(want))
    assert native.calls == 0 and not g.checks and not log


def test_the_check_runs_inside_compile_and_grad(cpu_gated):
    # The trainer's step is compiled: the first call traces, and the gate's
    # self-check evaluates its own arrays meanwhile.
    g, log = cpu_gated(Native())
    h, w, y, _ = _problem(False)

    def loss(h_):
        return -fc.flash_cce_forward(h_, w, y, stream=mx.cpu, validate_targets=False)[0].sum()

    got = mx.compile(mx.grad(loss))(h)
    assert g.checks[HeadSpec.of(h, w).key].passed and not log
    want = mx.grad(lambda h_: -_ext.forward(h_, w, y, stream=mx.cpu)[0].sum())(h)
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_the_check_sets_each_problems_plan_limits_and_clears_them():
    # The Metal path takes split and round limits per problem (one split of
    # many blocks in rounds at a small size); they must not outlive the problem.
    calls = []

    class Limited(Native):
        def metal_plan_limits(self, max_splits=0, round_blocks=0, stream=None):
            calls.append((max_splits, round_blocks, stream))

    probs = [p for p in PROBLEMS if p.max_splits][:2]
    assert any(p.round_blocks for p in probs)
    assert self_check(SPECS[0], Limited(), mx.cpu, probs).passed
    want = []
    for p in probs:
        want += [(p.max_splits, p.round_blocks, mx.cpu), (0, 0, mx.cpu)]
    assert calls == want


def test_the_shipped_problems_cover_what_the_check_must_see():
    # A float32 problem off the bfloat16 grid, a dense H with a partial tile, a
    # custom ignore_index that is a real token id, and one split of >= 64 blocks.
    assert any(p.off_grid for p in PROBLEMS)
    assert any(p.hidden % 32 for p in PROBLEMS)
    assert any(0 <= p.ignore_index < p.V and p.ignored for p in PROBLEMS)
    assert any(p.max_splits == 1 and -(-p.V // 32) >= 64 and 0 < p.round_blocks < 64
               for p in PROBLEMS)


class EntropyNative(Native):
    """The CPU kernels with their entropy statistics, the entropy optionally
    off by `shift` (a defect)."""

    def __init__(self, shift=0.0):
        super().__init__()
        self.shift = shift

    def forward(self, *args, stats=False, **kw):
        out = super().forward(*args, stats=stats, **kw)
        if stats and self.shift:
            out = [out[0], out[1], out[2] + self.shift, *out[3:]]
        return out


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[2], SPECS[4], SPECS[5]],
                         ids=lambda s: s.key)
def test_entropy_check_passes_the_cpu_kernels(spec):
    result = self_check(spec, EntropyNative(), mx.cpu, SMALL, entropy=True)
    assert result.passed, result.detail
    assert 0 < result.worst <= 1


def test_entropy_check_passes_the_cpu_kernels_on_the_shipped_problems():
    result = self_check(SPECS[1], EntropyNative(), mx.cpu, entropy=True)
    assert result.passed, result.detail


def test_entropy_check_refuses_a_wrong_entropy_apart_from_logp():
    g, log = gate(EntropyNative(shift=0.05))
    assert g.allows(SPECS[0])  # calls without the entropy keep the kernels
    assert not log
    assert not g.allows(SPECS[0], entropy=True)
    result = g.checks[SPECS[0].key + ", entropy"]
    assert result.worst > 1 and result.detail.startswith("entropy")
    assert len(log) == 1 and "entropy" in log[0]
    # A native path without the statistics fails the entropy's check, saying so.
    plain = Native()
    plain.supports_stats = lambda device: False
    result = self_check(SPECS[0], plain, mx.cpu, SMALL, entropy=True)
    assert not result.passed and "no entropy statistics" in result.detail
