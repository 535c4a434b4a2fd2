"""Adaptive preference weight: a P / PD / PID controller that holds the chosen
response's NLL near a target by moving the weight of the preference term.

A large preference weight (ORPO's lambda, CPO's preference term) can push the
chosen response's likelihood down while the margin grows. The controller reads
the training step's `nll_loss` (the process variable) and sets `pref_weight`
(the actuator, see `losses`) for the next step:

    e_t = target - NLL_t                   (> 0: NLL below target, room for more weight)
    w_t = w_0 + kp e_t + ki sum(e) + kd (e_t - e_{t-1})

then moved at most `max_change` from the last weight and kept in
[`min_weight`, `max_weight`]. The P law uses kp only, PD kp and kd, PID all three.
The sum stops growing while the weight sits at a bound and the error pushes
past it (no wind-up). The target is given, or the mean NLL of the first
`target_steps` steps times (1 + `tolerance`); the weight stays at w_0 until
then. The whole state is plain floats, saved with each checkpoint, so a resumed
run continues with the same weights.
"""

import math
from dataclasses import asdict, dataclass
from typing import Optional

LAWS = ("p", "pd", "pid")


@dataclass
class ControllerConfig:
    law: str = "pid"
    kp: float = 2.0  # weight per nat of NLL error
    ki: float = 0.2
    kd: float = 0.0
    target: Optional[float] = None  # NLL to hold; None: the initial NLL times (1 + tolerance)
    tolerance: float = 0.05
    target_steps: int = 5  # steps whose mean NLL is the initial NLL
    min_weight: float = 0.0
    max_weight: float = 10.0
    max_change: float = 0.05  # the most the weight moves in one step

    def validate(self):
        if self.law not in LAWS:
            raise ValueError(f"controller law must be one of {list(LAWS)}, got {self.law!r}")
        for name in ("kp", "ki", "kd", "tolerance", "min_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"controller {name} must be >= 0, got {getattr(self, name)}")
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
        self.start = []  # NLLs of the first steps, until the target is set

    def update(self, nll):
        """Feeds the NLL measured at a step; returns the weight for the next one."""
        nll = float(nll)
        if not math.isfinite(nll):
            raise ValueError(f"the controller needs a finite chosen NLL, got {nll}")
        cfg = self.cfg
        if self.target is None:
            self.start.append(nll)
            if len(self.start) < cfg.target_steps:
                return self.weight
            self.target = sum(self.start) / len(self.start) * (1 + cfg.tolerance)
        error = self.target - nll
        integral = self.integral + error if cfg.law == "pid" else 0.0
        change = 0.0 if self.last_error is None or cfg.law == "p" else error - self.last_error
        raw = self.base + cfg.kp * error + cfg.ki * integral + cfg.kd * change
        low = max(cfg.min_weight, self.weight - cfg.max_change)
        high = min(cfg.max_weight, self.weight + cfg.max_change)
        weight = min(max(raw, low), high)
        # Integrate only while the output follows the law, or the error pulls it back.
        if weight == raw or (raw > high) != (error > 0):
            self.integral = integral
        self.last_error = error
        self.weight = weight
        return weight

    def state(self):
        return dict(config=asdict(self.cfg), base=self.base, weight=self.weight, target=self.target,
                    integral=self.integral, last_error=self.last_error, start=list(self.start))

    @classmethod
    def from_state(cls, state):
        c = cls(ControllerConfig(**state["config"]), state["base"])
        for k in ("weight", "target", "integral", "last_error"):
            setattr(c, k, state[k])
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
