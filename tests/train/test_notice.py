"""The one-line notice when a run's first validation or step is slow (MLX compiling its kernels)."""

import time

import mlx.optimizers as optim

from flash_cce.train import notice
from flash_cce.train.notice import SlowStart
from flash_cce.train.objectives import ObjectiveConfig
from flash_cce.train.objectives import value_and_grad as real_value_and_grad
from flash_cce.train.trainer import TrainingArgs, train

from test_trainer import fresh, setup  # noqa: F401 (a fixture)


def test_slow_work_gets_one_line_and_its_time():
    lines = []
    with SlowStart("The first step", lines.append, after=0.05):
        time.sleep(0.4)
    assert len(lines) == 2
    assert lines[0].startswith("The first step is still running after 0.05 s: this may be MLX compiling")
    assert lines[1].startswith("The first step took ") and float(lines[1].split()[4]) >= 0.4


def test_quick_work_and_no_log_say_nothing():
    lines = []
    with SlowStart("The first step", lines.append, after=5.0):
        pass
    time.sleep(0.1)
    assert lines == []
    watch = SlowStart("The first step", None, after=0.0).start()  # no log: no timer at all
    assert watch.timer is None
    watch.stop()


def test_the_trainer_says_when_its_first_step_is_slow(setup, monkeypatch):
    """Only the first step (and the first validation) is watched: a slow later step says nothing."""
    model_dir, train_pairs, val_pairs = setup
    monkeypatch.setattr(notice, "AFTER_SECONDS", 0.05)
    calls = []

    def slow_value_and_grad(model, pairs, objective):
        calls.append(1)
        if len(calls) in (1, 3):  # the first step, and the third
            time.sleep(0.3)
        return real_value_and_grad(model, pairs, objective)

    lines = []
    train(fresh(model_dir), optim.SGD(learning_rate=0.1), train_pairs, val_pairs,
          TrainingArgs(batch_size=2, iters=3, steps_per_eval=0, val_batches=1, progress=False,
                       steps_per_report=100), ObjectiveConfig(), value_and_grad=slow_value_and_grad,
          log=lines.append)
    # The first validation may be slow too on a loaded machine; no later step speaks.
    slow = [line for line in lines if "still running" in line and not line.startswith("The first validation")]
    assert len(slow) == 1 and slow[0].startswith("The first step is still running")
    assert sum(line.startswith("The first step took") for line in lines) == 1


def test_work_cut_short_gets_no_time_and_a_failing_log_is_ignored():
    lines = []
    try:
        with SlowStart("The first step", lines.append, after=0.05):
            time.sleep(0.3)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert len(lines) == 1 and "still running" in lines[0]  # no "took": it did not finish

    def broken(line):
        raise OSError("stdout closed")

    with SlowStart("The first step", broken, after=0.0):
        time.sleep(0.1)


def test_the_lines_come_in_order_even_when_logging_is_slow():
    """A `stop()` racing the timer's line waits for it: never a time before the notice, and
    never a notice after the time."""
    for after in (0.0, 0.001, 0.005, 0.02):
        lines = []

        def slow_log(line):
            time.sleep(0.03)
            lines.append(line)

        watch = SlowStart("The first step", slow_log, after=after).start()
        time.sleep(0.01)
        watch.stop()
        time.sleep(0.05)  # a late timer line would land here
        assert lines == [] or (len(lines) == 2 and "still running" in lines[0] and "took" in lines[1]), lines
