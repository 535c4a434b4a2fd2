"""What a training run prints as it goes: a progress bar on a terminal, else one
line every `steps_per_report` steps (as mlx_lm.lora prints), so that a log file
gets lines and never a bar's carriage returns."""

import sys


def use_bar(progress, stream=None):
    """A bar only when asked for and stderr (where tqdm draws) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return bool(progress) and hasattr(stream, "isatty") and stream.isatty()


def report_line(step, iters, window, learning_rate):
    """One report: `window` holds the step records since the last one."""
    n = len(window)
    mean = lambda k: sum(r[k] for r in window if k in r) / max(sum(k in r for r in window), 1)  # noqa: E731
    seconds = sum(r["step_time"] for r in window)
    tokens = sum(r["tokens"] for r in window)
    parts = [f"step {step}/{iters}: loss {mean('loss'):.4f}"]
    if any("rewards/accuracies" in r for r in window):
        parts.append(f"accuracy {mean('rewards/accuracies'):.3f}")
    if any("reward" in r for r in window):  # grpo: the mean reward of the step's completions
        parts.append(f"reward {mean('reward'):.3f}")
    parts += [f"lr {learning_rate:.3e}", f"{n / seconds if seconds else 0.0:.2f} steps/s",
              f"{tokens / seconds if seconds else 0.0:.0f} tokens/s",
              f"peak {max(r['peak_memory_gb'] for r in window):.2f} GB"]
    return ", ".join(parts)


class Reporter:
    """Either a tqdm bar or report lines through `log`."""

    def __init__(self, iters, start, steps_per_report, bar, log=print):
        self.iters, self.every, self.log, self.window = iters, steps_per_report, log, []
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=iters, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def step(self, record):
        if self.bar is not None:
            shown = {"loss": f"{record['loss']:.3f}"}
            if "reward" in record:
                shown["reward"] = f"{record['reward']:.3f}"
            else:
                shown["acc"] = f"{record.get('rewards/accuracies', float('nan')):.2f}"
            self.bar.set_postfix(**shown)
            self.bar.update(1)
            return
        self.window.append(record)
        step = record["step"]
        if self.every and (step % self.every == 0 or step == self.iters):
            self.log(report_line(step, self.iters, self.window, record["learning_rate"]))
            self.window = []

    def write(self, line):
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.log(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _schedule_text(cfg):
    s, lr, iters, warmup = cfg["lr_schedule"], cfg["learning_rate"], cfg["iters"], cfg["warmup"]
    if isinstance(s, dict):
        args = ", ".join(f"{a:g}" for a in s["arguments"])
        text = f"mlx_lm.lora's {s['name']}({args})"
        if s["warmup"]:
            text = f"linear warmup {s['warmup_init']:g} -> {s['arguments'][0]:g} over {s['warmup']} steps, then " + text
        return text + " (learning_rate, min_learning_rate and warmup unused)"
    text = f"linear warmup 0 -> {lr:g} over {warmup} steps, then " if warmup else ""
    if s == "constant":
        return text + f"constant {lr:g}"
    return text + f"{s} decay {lr:g} -> {cfg['min_learning_rate']:g} over {iters - warmup} steps"


def run_summary(cfg):
    """The run's effective schedule, optimizer and evaluation cadence, as lines."""
    clip = cfg["max_grad_norm"]
    val = cfg["val_batches"]
    every = cfg["steps_per_eval"]
    lines = [
        f"Schedule: {_schedule_text(cfg)}; {cfg['iters']} steps of {cfg['batch_size']} x "
        f"{cfg['grad_accumulation_steps']} micro-batches",
        f"Optimizer: AdamW (weight decay {cfg['weight_decay']:g}, betas 0.9, 0.999, eps 1e-8), "
        + (f"gradient norm clipped at {clip:g}" if clip is not None else "no gradient clipping"),
        "Validation: " + ("none (val_batches 0)" if val == 0 else
                          f"at step 0, {'every ' + str(every) + ' steps and ' if every else ''}at the end, over "
                          + ("all" if val == -1 else f"at most {val}") + " micro-batches")
        + f"; a report line every {cfg['steps_per_report']} steps; a checkpoint "
        + (f"every {cfg['save_every']} steps" if cfg["save_every"] else "at the end"),
    ]
    return "\n".join(lines)
