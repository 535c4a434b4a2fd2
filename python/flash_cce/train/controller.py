"""Adaptive preference weight: a P / PD / PID controller that holds the chosen
response's NLL near a target by moving the weight of the preference term.

A large preference weight (ORPO's lambda, CPO's preference term) can push the
chosen response's likelihood down while the margin grows. The controller reads
the training step's `nll_loss` and sets `pref_weight` (the actuator, see
`losses`) for the next step. Its process variable is the NLL smoothed over
steps, `m_t = a m_{t-1} + (1 - a) NLL_t` (`smoothing` a; 0: the step's own),
since one batch's NLL is noisy. With `scale = "log"` (the default) the error
and the weight are ratios:

    e_t = log(target / m_t)                (> 0: NLL below target, room for more weight)
    w_t = w_0 exp(kp e_t + ki sum(e) + kd (e_t - e_{t-1}))

and the weight moves by at most a factor exp(`max_change`) a step. An optimizer
that normalises its steps (Adam) responds to the ratio of the loss's terms, not
their size, so the weight that holds the NLL can be orders of magnitude below
w_0; ratios reach it at the same pace at every scale. With `scale = "linear"`:

    e_t = target - m_t  (nats),   w_t = w_0 + kp e_t + ki sum(e) + kd (e_t - e_{t-1}),

moved at most `max_change` a step. Either way the weight stays in
[`min_weight`, `max_weight`]; the P law uses kp only, PD kp and kd, PID all
three; the sum stops growing while the weight sits at a bound and the error
pushes past it (no wind-up). The target is given, or the mean NLL of the first
`target_steps` steps times (1 + `tolerance`); the weight stays at w_0 until then.
The whole state is plain floats, saved with each checkpoint, so a resumed run
continues with the same weights.
"""

import math
from dataclasses import asdict, dataclass
from typing import Optional

LAWS = ("p", "pd", "pid")
SCALES = ("log", "linear")
# What a state saved before `scale` and `smoothing` existed ran with.
_BEFORE_SCALES = dict(scale="linear", smoothing=0.0)
_TINY = 2.0**-126  # the smallest normal float32


@dataclass
class ControllerConfig:
    law: str = "pid"
    scale: str = "log"  # errors and weights as ratios (log) or differences (linear)
    kp: float = 2.0  # weight change per unit of error (log: of log-weight per log-ratio)
    ki: float = 0.2
    kd: float = 0.0
    smoothing: float = 0.9  # of the measured NLL over steps; 0: none
    target: Optional[float] = None  # NLL to hold; None: the initial NLL times (1 + tolerance)
    tolerance: float = 0.05
    target_steps: int = 5  # steps whose mean NLL is the initial NLL
    min_weight: float = 0.001
    max_weight: float = 10.0
    max_change: float = 0.2  # the most the weight moves in one step (log: of its log)

    def validate(self):
        if self.law not in LAWS:
            raise ValueError(f"controller law must be one of {list(LAWS)}, got {self.law!r}")
        if self.scale not in SCALES:
            raise ValueError(f"controller scale must be one of {list(SCALES)}, got {self.scale!r}")
        for name in ("kp", "ki", "kd", "tolerance", "min_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"controller {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.smoothing < 1:
            raise ValueError(f"controller smoothing must be in [0, 1), got {self.smoothing}")
        if self.scale == "log" and not self.min_weight > 0:
            raise ValueError(f"controller min_weight must be > 0 with scale log (a ratio never reaches 0), "
                             f"got {self.min_weight}")
        if self.target is not None and not self.target > 0:
            raise ValueError(f"controller target must be > 0 (an NLL in nats) or unset, got {self.target}")
        if self.target_steps < 1:
            raise ValueError(f"controller target_steps must be >= 1, got {self.target_steps}")
        if not self.max_weight >= self.min_weight:
            raise ValueError(f"controller max_weight must be >= min_weight={self.min_weight}, "
                             f"got {self.max_weight}")
        if not self.max_change > 0:
            raise ValueError(f"controller max_change must be > 0, got {self.max_change}")


class Controller:
    """The controller's state and law; `update` once per optimizer step."""

    def __init__(self, cfg, weight):
        cfg.validate()
        if not cfg.min_weight <= weight <= cfg.max_weight:
            raise ValueError(f"the initial preference weight {weight} is outside the controller's "
                             f"bounds [{cfg.min_weight}, {cfg.max_weight}]")
        self.cfg = cfg
        self.base = float(weight)
        self.weight = float(weight)
        self.target = cfg.target
        self.integral = 0.0
        self.last_error = None
        self.measured = None  # the smoothed NLL
        self.start = []  # NLLs of the first steps, until the target is set

    def update(self, nll):
        """Feeds the NLL measured at a step; returns the weight for the next one."""
        nll = float(nll)
        if not (math.isfinite(nll) and nll >= 0):
            raise ValueError(f"the controller needs a finite chosen NLL >= 0, got {nll}")
        cfg = self.cfg
        a = cfg.smoothing
        self.measured = nll if self.measured is None else a * self.measured + (1 - a) * nll
        if self.target is None:
            self.start.append(nll)
            if len(self.start) < cfg.target_steps:
                return self.weight
            self.target = sum(self.start) / len(self.start) * (1 + cfg.tolerance)
        log = cfg.scale == "log"
        # (An NLL of 0, every token certain, is as far below the target as float32 goes.)
        error = (math.log(self.target / max(self.measured, _TINY)) if log
                 else self.target - self.measured)
        integral = self.integral + error if cfg.law == "pid" else 0.0
        change = 0.0 if self.last_error is None or cfg.law == "p" else error - self.last_error
        u = cfg.kp * error + cfg.ki * integral + cfg.kd * change
        # In the actuator's own terms (log-weight or weight): the law, the rate limit, the bounds.
        to, back = (math.log, math.exp) if log else (float, float)
        raw = to(self.base) + u
        low = max(to(cfg.min_weight), to(self.weight) - cfg.max_change)
        high = min(to(cfg.max_weight), to(self.weight) + cfg.max_change)
        held = min(max(raw, low), high)
        # Integrate only while the output follows the law, or the error pulls it back.
        if held == raw or (raw > high) != (error > 0):
            self.integral = integral
        self.last_error = error
        self.weight = min(max(back(held), cfg.min_weight), cfg.max_weight)
        return self.weight

    def state(self):
        return dict(config=asdict(self.cfg), base=self.base, weight=self.weight, target=self.target,
                    integral=self.integral, last_error=self.last_error, measured=self.measured,
                    start=list(self.start))

    @classmethod
    def from_state(cls, state):
        c = cls(ControllerConfig(**{**_BEFORE_SCALES, **state["config"]}), state["base"])
        for k in ("weight", "target", "integral", "last_error"):
            setattr(c, k, state[k])
        # Without smoothing the measurement is the step's NLL: the saved one is not needed.
        c.measured = state.get("measured")
        c.start = list(state["start"])
        return c


def for_objective(objective, settings=None):
    """A Controller of `objective`'s preference weight, from a dict of
    ControllerConfig fields (unknown keys are named in the error)."""
    from .losses import PREF_WEIGHTED

    if objective.name not in PREF_WEIGHTED:
        raise ValueError(f"adaptive_weight needs an objective with an NLL and a weighted preference "
                         f"term ({', '.join(PREF_WEIGHTED)}), got {objective.name!r}")
    settings = dict(settings or {})
    known = set(ControllerConfig.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"controller: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return Controller(ControllerConfig(**settings), objective.pref_weight)


def for_settings(cfg, objective):
    """The controller that the settings `cfg` ask for (adaptive_weight), or None."""
    return for_objective(objective, cfg["controller"]) if cfg["adaptive_weight"] else None
