"""The non-finite guard of a training loop: a step whose loss or gradient norm is
not finite leaves the weights as they were, `max_nonfinite_steps` of them in a
row stop the run (`NonFinite`, naming the last checkpoint whose weights gave a
finite loss), and no checkpoint holds weights that gave a non-finite loss last.

The loop keeps `nonfinite_steps` (skipped so far) and `finite_checkpoint` (the
newest checkpoint a later step found finite) in its saved state, so a resume
keeps them.
"""

import math

from . import checkpoint
from .checkpoint import NonFinite


class Guard:
    """One loop's guard over `state` (the loop's saved dict); `resumed`: the
    loop continues a checkpoint (whose weights no step has used yet)."""

    def __init__(self, state, max_steps, run_dir, writer, resumed=False):
        state.setdefault("nonfinite_steps", 0)
        state.setdefault("finite_checkpoint", None)
        self.state, self.max_steps, self.run_dir, self.writer = state, max_steps, run_dir, writer
        self.streak, self.suspect = 0, False  # non-finite steps in a row; weights that gave one
        # The newest checkpoint while no step has used its weights.
        self.unproven = state["step"] if resumed and state["finite_checkpoint"] != state["step"] else None

    def check(self, loss, norm, world=None):
        """Whether the step's loss and gradient norm are finite (on every rank);
        counts the step either way."""
        import mlx.core as mx

        finite = math.isfinite(loss) and math.isfinite(norm)
        if world is not None and world.size() > 1:  # every rank skips the same steps
            finite = mx.distributed.all_sum(mx.array(int(not finite)), group=world).item() == 0
        if finite:
            self.streak = 0
            if self.unproven is not None:  # this step's loss came from that checkpoint's weights
                self.state["finite_checkpoint"], self.unproven = self.unproven, None
        else:
            self.streak += 1
            self.state["nonfinite_steps"] += 1
        self.suspect = self.streak > 0
        return finite

    def record(self):
        """The step record's counters (TRL-style names)."""
        return {"nonfinite/skipped_steps": self.state["nonfinite_steps"], "nonfinite/consecutive": self.streak}

    def after(self, step, detail, warn):
        """After a non-finite step's record: `warn` the line; raises `NonFinite`
        at `max_steps` in a row."""
        warn(f"step {step}: non-finite {detail}; update skipped ({self.streak} in a row, the run stops at "
             f"{self.max_steps})")
        if self.streak >= self.max_steps:
            raise NonFinite(step, self.streak, self.fall_back() if self.writer else None, detail)

    def protect(self):
        """Checkpoint directories the rotation must keep."""
        good = self.state["finite_checkpoint"]
        return [checkpoint.step_dir(self.run_dir, good)] if good is not None else []

    def saved(self, step, proven):
        """A checkpoint of `step` was written; `proven`: its weights are known
        finite (a finite validation)."""
        if proven:
            self.state["finite_checkpoint"] = step
        self.unproven = None if proven else step

    def fall_back(self):
        """Points adapters at the last checkpoint whose weights gave a finite loss
        (removes it when there is none): never at weights that diverged. Returns it."""
        good = self.state["finite_checkpoint"]
        if good is None:
            checkpoint.unlink(self.run_dir, "adapters")
            return None
        checkpoint.link(self.run_dir, "adapters", checkpoint.step_dir(self.run_dir, good))
        return checkpoint.step_dir(self.run_dir, good)

    def finish(self, log):
        """At the end of the loop: adapters off weights that gave a non-finite loss."""
        if self.suspect and self.writer:
            good = self.fall_back()
            log(f"[warning] the last weights gave a non-finite loss; adapters holds "
                f"{good or 'nothing (no checkpoint gave a finite loss)'}")
