"""The adaptive preference weight: its law in closed form, its bounds, a
simulated drift it must hold, and exact resume through `flash-cce train`."""

import json
import math

import numpy as np
import pytest

from flash_cce.train.cli import main
from flash_cce.train.controller import Controller, ControllerConfig, for_objective
from flash_cce.train.objectives import ObjectiveConfig
from flash_cce.train.trainer import read_metrics
from test_cli import _train_argv
from test_trainer import tiny_setup


# The additive law on each step's own NLL (scale linear, no smoothing).
LINEAR = dict(scale="linear", smoothing=0.0)


def test_p_law_is_rate_limited_and_bounded():
    c = Controller(ControllerConfig(**LINEAR, law="p", kp=2.0, target=3.0, max_change=0.05, max_weight=1.12,
                                    target_steps=1), 1.0)
    # e = 0.5: the law asks for 1 + 2 * 0.5 = 2; the weight climbs 0.05 a step to the bound.
    assert [c.update(2.5) for _ in range(4)] == pytest.approx([1.05, 1.10, 1.12, 1.12], abs=1e-12)
    # e = -0.05: the law asks for 1 - 0.1 = 0.9, reached in steps of 0.05 and held.
    assert [c.update(3.05) for _ in range(6)] == pytest.approx([1.07, 1.02, 0.97, 0.92, 0.9, 0.9],
                                                             abs=1e-12)


def test_target_is_the_initial_nll_times_one_plus_tolerance():
    c = Controller(ControllerConfig(**LINEAR, law="pd", kp=1.0, kd=0.5, tolerance=0.1, target_steps=3,
                                    max_change=10.0), 1.0)
    assert c.update(2.0) == 1.0 and c.update(4.0) == 1.0 and c.target is None
    w = c.update(3.0)  # the third NLL sets the target and gives the first error
    assert c.target == pytest.approx(3.3)
    assert w == pytest.approx(1.0 + 1.0 * 0.3)  # no derivative before a second error
    assert c.update(3.1) == pytest.approx(1.0 + 0.2 + 0.5 * (0.2 - 0.3))


def _drift(controller, weight=2.0, steps=400, seed=0):
    """A chosen NLL that rises while the weight exceeds 0.5 and falls below it."""
    rng = np.random.default_rng(seed)
    nll, trace = 2.0, []
    for _ in range(steps):
        w = controller.weight if controller is not None else weight
        nll += 0.05 * (w - 0.5) + 0.002 * rng.standard_normal()
        trace.append(nll)
        if controller is not None:
            controller.update(nll)
    return np.array(trace)


@pytest.mark.parametrize("law", ["p", "pd", "pid"])
def test_controller_holds_a_drifting_nll_in_its_band(law):
    cfg = ControllerConfig(**LINEAR, law=law, kp=2.0, ki=0.1 if law == "pid" else 0.0,
                           kd=0.5 if law != "p" else 0.0, tolerance=0.05, target_steps=5, max_change=0.05,
                           min_weight=0.0)
    c = Controller(cfg, 2.0)
    held = _drift(c)
    fixed = _drift(None)
    # The drift stops where the weight is 0.5. Without an integral the law gives
    # 0.5 = 2 + kp * e only at e = -1.5 / kp: P and PD settle that far above the
    # target; PID settles on it.
    settle = c.target + (0.0 if law == "pid" else 1.5 / cfg.kp)
    band = c.target * 0.02
    assert np.abs(held[-100:] - settle).max() < band
    assert fixed[-1] - settle > 10 * band  # the same weight, never lowered, drifts away
    assert abs(c.weight - 0.5) < 0.05


def test_log_law_moves_the_weight_by_ratios():
    # target 2, w0 1, kp 2, rate limit e^0.2 a step, the step's own NLL.
    c = Controller(ControllerConfig(law="p", kp=2.0, target=2.0, smoothing=0.0, max_change=0.2,
                                    min_weight=0.01), 1.0)
    # NLL = 2 e^-0.05: e = 0.05, the law asks w0 e^0.1.
    assert c.update(2.0 * math.exp(-0.05)) == pytest.approx(math.exp(0.1), rel=1e-12)
    # NLL = 2 e^0.5: e = -0.5, the law asks e^-1, reached by factors of e^-0.2 and held.
    got = [c.update(2.0 * math.exp(0.5)) for _ in range(8)]
    want = [math.exp(x) for x in (-0.1, -0.3, -0.5, -0.7, -0.9, -1.0, -1.0, -1.0)]
    assert got == pytest.approx(want, rel=1e-12)


def test_smoothing_is_an_exponential_average_of_the_nll():
    c = Controller(ControllerConfig(law="p", kp=1.0, target=1.0, smoothing=0.75, max_change=10.0,
                                    min_weight=1e-6, max_weight=1e6), 1.0)
    m = None
    for nll in (1.0, 3.0, 0.5, 2.0):
        m = nll if m is None else 0.75 * m + 0.25 * nll
        assert c.update(nll) == pytest.approx(1.0 / m, rel=1e-12)  # w0 exp(log(target / m))
        assert c.measured == pytest.approx(m, rel=1e-12)


def _ratio_drift(controller, steps=600, seed=0):
    """A chosen NLL whose logarithm rises while the weight is above 0.01 and falls
    below it, drifts a little, and is measured with one batch's noise (20 %); a
    fixed weight of 5 lets it grow without bound. Returns (measured, smoothed as
    the controller smooths)."""
    rng = np.random.default_rng(seed)
    log_nll, measured = math.log(0.05), []
    for _ in range(steps):
        w = controller.weight if controller is not None else 5.0
        log_nll += 0.01 * math.log(w / 0.01) + 0.01 * rng.standard_normal()
        measured.append(math.exp(log_nll + 0.2 * rng.standard_normal()))
        if controller is not None:
            controller.update(measured[-1])
    a, m, smooth = ControllerConfig().smoothing, None, []
    for x in measured:
        m = x if m is None else a * m + (1 - a) * x
        smooth.append(m)
    return np.array(measured), np.array(smooth)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_pid_holds_a_drift_whose_weight_is_far_below_the_start(seed):
    """The weight that stops the drift is 500 times below w0: the default ratio
    law gets there and keeps the NLL within a factor 2 of its target, where the
    fixed weight lets it grow a hundredfold."""
    c = Controller(ControllerConfig(), 5.0)
    _, held = _ratio_drift(c, seed=seed)
    assert np.abs(np.log(held[300:] / c.target)).max() < math.log(2)
    assert 0.002 < c.weight < 0.05
    _, fixed = _ratio_drift(None, seed=seed)
    assert fixed[-50:].min() > 100 * c.target


def test_state_saved_before_scales_resumes_the_linear_law():
    """A state from before `scale` and `smoothing` existed continues as it ran."""
    keys = ("law", "kp", "ki", "kd", "target", "tolerance", "target_steps", "min_weight", "max_weight",
            "max_change")
    old = dict(law="pid", kp=1.0, ki=0.3, kd=0.2, target=None, tolerance=0.05, target_steps=2,
               min_weight=0.0, max_weight=10.0, max_change=0.05)
    a = Controller(ControllerConfig(**old, **LINEAR), 1.0)
    nlls = np.random.default_rng(4).uniform(1.0, 3.0, 20)
    for x in nlls[:7]:
        a.update(x)
    saved = a.state()
    saved = dict(saved, config={k: saved["config"][k] for k in keys})
    del saved["measured"]
    b = Controller.from_state(json.loads(json.dumps(saved)))
    assert [a.update(x) for x in nlls[7:]] == [b.update(x) for x in nlls[7:]]


def test_weights_stay_in_bounds_and_rate_limits():
    cfg = ControllerConfig(**LINEAR, law="pid", kp=5.0, ki=1.0, kd=1.0, target=2.0, min_weight=0.2,
                           max_weight=1.5, max_change=0.1)
    c = Controller(cfg, 1.0)
    rng = np.random.default_rng(1)
    last = c.weight
    for nll in rng.uniform(0.5, 4.0, 300):
        w = c.update(nll)
        assert 0.2 <= w <= 1.5 and abs(w - last) <= 0.1 + 1e-12
        last = w


def test_integral_does_not_wind_up_at_a_bound():
    c = Controller(ControllerConfig(**LINEAR, law="pid", kp=0.0, ki=1.0, target=2.0, max_weight=1.2,
                                    max_change=5.0), 1.0)
    assert [c.update(1.0) for _ in range(10)] == [1.2] * 10  # the law asks 2, 3, ...: held at 1.2
    # Had the integral kept the ten errors of +1 it would ask 10.5 now; it kept none.
    assert c.update(2.5) == pytest.approx(0.5)


def test_state_round_trips_through_json():
    cfg = ControllerConfig(law="pid", kp=1.0, ki=0.3, kd=0.2, target_steps=2)
    a = Controller(cfg, 1.0)
    rng = np.random.default_rng(2)
    nlls = rng.uniform(1.0, 3.0, 20)
    for x in nlls[:7]:
        a.update(x)
    b = Controller.from_state(json.loads(json.dumps(a.state())))
    assert [a.update(x) for x in nlls[7:]] == [b.update(x) for x in nlls[7:]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(law="pi"), r"controller law must be one of \['p', 'pd', 'pid'\], got 'pi'"),
    (dict(kp=-1.0), "controller kp must be >= 0"),
    (dict(target=0.0), "controller target must be > 0"),
    (dict(min_weight=2.0, max_weight=1.0), "controller max_weight must be >= min_weight"),
    (dict(max_change=0.0), "controller max_change must be > 0"),
    (dict(scale="ln"), r"controller scale must be one of \['log', 'linear'\], got 'ln'"),
    (dict(smoothing=1.0), r"controller smoothing must be in \[0, 1\)"),
    (dict(min_weight=0.0), "controller min_weight must be > 0 with scale log"),
])
def test_bad_controller_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        for_objective(ObjectiveConfig(name="orpo"), kwargs)


def test_controller_needs_a_weighted_objective():
    with pytest.raises(ValueError, match="adaptive_weight needs .* got 'dpo'"):
        for_objective(ObjectiveConfig(name="dpo"), {})
    with pytest.raises(ValueError, match="controller: unknown key 'gain'"):
        for_objective(ObjectiveConfig(name="orpo"), {"gain": 1})
    with pytest.raises(ValueError, match="outside the controller's bounds"):
        for_objective(ObjectiveConfig(name="cpo", pref_weight=20.0), {})


def test_pref_weight_is_logged_and_resumed_exactly(tmp_path):
    model_dir, data_dir = tiny_setup(tmp_path)
    extra = ("--adaptive-weight", "--pref-weight", "2.0", "--controller-target-steps", "1",
             "--controller-kp", "20", "--controller-max-change", "0.3", "--beta", "0.5")
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(_train_argv(model_dir, data_dir, straight, 4, *extra)) == 0
    assert main(_train_argv(model_dir, data_dir, cut, 2, *extra)) == 0
    assert main(["train", "--resume", str(cut), "--iters", "4"]) == 0

    def trace(run):
        return [(r["step"], r["pref_weight"], r["loss"]) for r in read_metrics(run) if r["split"] == "train"]

    assert trace(cut) == trace(straight)
    weights = [w for _, w, _ in trace(straight)]
    assert weights[0] == 2.0 and len(set(weights)) > 2  # the controller moved it
    # The default scale is log: each step moves the weight by a factor of at most e^0.3.
    assert all(abs(math.log(b / a)) <= 0.3 + 1e-12 for a, b in zip(weights, weights[1:]))
