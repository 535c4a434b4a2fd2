"""The compiled layers' kernels built by a second process (`train.warmup`): the
plan's gate, the helper's life, its kernels' move into the cache, and a run
that switches to the compiled layers once the helper is done."""

import os
import subprocess
import sys
import time

import pytest

from flash_cce.stack import plan as stack_plan
from flash_cce.stack.batch import Example, Pair
from flash_cce.stack.plan import StackConfig
from flash_cce.train import settings, warmup
from flash_cce.train.cli import build_parser
from flash_cce.train.runner import run_train, train_settings
from flash_cce.train.warmup import Warmup, publish, wanted
from flash_cce.train.warmup_step import ONE_STEP
from test_trainer import tiny_setup


def _compiled(config, monkeypatch, tokens=10_000):
    monkeypatch.setattr(stack_plan, "on_cuda", lambda: True)
    return stack_plan._plan(None, config, [[1] * 8], None, tokens, lambda: True).compiled


def test_default_waits_for_compiled_when(monkeypatch):
    assert _compiled(StackConfig(), monkeypatch)
    assert not _compiled(StackConfig(compiled_when=lambda: False), monkeypatch)
    assert _compiled(StackConfig(compiled_when=lambda: True), monkeypatch)
    assert not _compiled(StackConfig(compiled_when=lambda: True), monkeypatch, tokens=100)  # short: never
    # An explicit choice does not wait.
    assert _compiled(StackConfig(compiled_layers=True, compiled_when=lambda: False), monkeypatch)
    with pytest.raises(ValueError, match="compiled_when must be None or a function, got 3"):
        StackConfig(compiled_when=3).validate()


def test_wanted_where_the_default_would_compile(monkeypatch):
    monkeypatch.setattr(stack_plan, "on_cuda", lambda: True)
    auto = {"compiled_layers": "auto"}
    long = Pair([1] * 5000, [2] * 5000, 10, 10)
    short = Pair([1] * 50, [2] * 50, 10, 10)
    assert wanted(auto, [short, long], ranks=1)
    assert not wanted(auto, [short], ranks=1)
    assert wanted(auto, [Example([1] * 4096, 10, True)], ranks=1)  # counted as its pair
    assert not wanted(auto, [long], ranks=2)
    assert not wanted({"compiled_layers": True}, [long], ranks=1)
    assert not wanted({"compiled_layers": False}, [long], ranks=1)
    monkeypatch.setattr(stack_plan, "on_cuda", lambda: False)
    assert not wanted(auto, [long], ranks=1)


def test_publish_moves_every_file_the_ptx_last(tmp_path, monkeypatch):
    private, cache = tmp_path / "private", tmp_path / "cache"
    (private / "long" / "name").mkdir(parents=True)
    files = {"a.ptx": "A", "a.txt": "a", "a.cu": "src", "long/name/b.ptx": "B", "long/name/b.txt": "b"}
    for rel, text in files.items():
        (private / rel).write_text(text)
    cache.mkdir()
    (cache / "a.ptx").write_text("old")
    moved = []
    real = os.replace
    monkeypatch.setattr(warmup.os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real(a, b)))
    publish(private, cache)
    assert {rel: (cache / rel).read_text() for rel in files} == files
    assert not [p for p in private.rglob("*") if p.is_file()]
    first_ptx = min(i for i, name in enumerate(moved) if name.endswith(".ptx"))
    assert all(not name.endswith(".ptx") for name in moved[:first_ptx]) and len(moved) == len(files)
    assert moved[first_ptx:] and all(n.endswith(".ptx") for n in moved[first_ptx:])


def _helper(code):
    """A stand-in helper: Python running `code` with its private cache in CACHE."""
    return [sys.executable, "-c", "import os, pathlib, sys, time; CACHE = pathlib.Path(os.environ["
            "'MLX_PTX_CACHE_DIR']); " + code]


def _wait(warm, timeout=60):
    end = time.time() + timeout
    while warm.state == "running" and time.time() < end:
        warm.ready()
        time.sleep(0.05)
    return warm.ready()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "mlx" / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(path))
    return path


CFG = {"model": "m", "fine_tune_type": "lora", "lora_parameters": {"rank": 8}, "compiled_layers": "auto"}


STEP = {"peak_memory_gb": 1.0, "tokens": 1000}
WRITE = "CACHE.mkdir(); (CACHE / 'k.txt').write_text('names'); (CACHE / 'k.ptx').write_text('code')"


def test_helper_kernels_reach_the_cache_and_mark_it(cache):
    lines = []
    warm = Warmup(CFG, lines.append, command=_helper(WRITE)).start()
    assert warm.state == "waiting" and not warm.ready()  # until the first step
    warm.after_step(STEP)
    assert warm.state == "running" and not (cache / "k.ptx").exists()
    assert warm.scratch.parent == cache / "flash-cce"  # one file system with the cache
    assert _wait(warm)
    assert (cache / "k.ptx").read_text() == "code" and (cache / "k.txt").read_text() == "names"
    assert warm.marker.exists() and not warm.scratch.exists()
    assert "second process" in lines[0] and "kernels ready after" in lines[1] and len(lines) == 2
    warm.close()
    # The same settings again: ready at once, no process.
    again = Warmup(dict(CFG), lines.append, command=_helper("sys.exit(9)")).start()
    assert again.ready()
    again.after_step(STEP)
    assert again.ready() and again.proc is None
    # Other adapters: another marker, another helper.
    other = Warmup(dict(CFG, lora_parameters={"rank": 16}), lines.append, command=_helper("pass"))
    assert other.marker != warm.marker
    other.close()


def test_no_marker_without_kernels(cache):
    warm = Warmup(CFG, lambda line: None, command=_helper("pass")).start().launch()
    assert _wait(warm) and not warm.marker.exists()  # MLX wrote nothing: a later run tries again


def test_close_publishes_a_helper_that_has_finished(cache):
    warm = Warmup(CFG, lambda line: None, command=_helper(WRITE)).start().launch()
    warm.proc.wait()  # done, but no step asked since
    warm.close()
    assert (cache / "k.ptx").read_text() == "code" and warm.marker.exists()


def test_a_failed_helper_leaves_the_run_to_compile_and_keeps_its_log(cache):
    lines = []
    fail = "print('out of memory'); CACHE.mkdir(); (CACHE / 'k.ptx').write_text('x'); sys.exit(3)"
    with Warmup(CFG, lines.append, command=_helper(fail)) as warm:
        warm.after_step(STEP)
        assert _wait(warm) and warm.state == "failed"
    log = warm.scratch / "warmup.log"
    assert lines[-1] == (f"Compiled layers: the second process failed (exit code 3; its output: {log}); "
                         "the run builds their kernels itself")
    assert "out of memory" in log.read_text()
    assert [p.name for p in warm.scratch.iterdir()] == ["warmup.log"]
    assert not (cache / "k.ptx").exists() and not warm.marker.exists()


def test_a_helper_that_cannot_start_leaves_the_run_to_compile(cache, tmp_path):
    lines = []
    warm = Warmup(CFG, lines.append, command=[str(tmp_path / "no-such-program")]).start().launch()
    assert warm.ready() and warm.proc is None and not warm.scratch.exists()
    assert "could not start a second process" in lines[0] and "the run builds them itself" in lines[0]
    assert not warm.marker.exists()


def test_no_helper_without_room_for_its_step(cache, monkeypatch):
    lines = []
    monkeypatch.setattr(warmup, "free_gpu_memory", lambda: 2e9)
    warm = Warmup(CFG, lines.append, command=_helper("pass")).start()
    warm.after_step({"peak_memory_gb": 1.7, "tokens": 1000})  # needs ROOM x 1.7 = 2.1 GB
    assert warm.ready() and warm.proc is None
    assert lines == ["Compiled layers: a second process to build their kernels would need about 2.1 GB of "
                     "GPU memory, 2.0 GB are free; the run builds them itself"]
    roomy = Warmup(CFG, lines.append, command=_helper("pass")).start()
    roomy.after_step({"peak_memory_gb": 1.5, "tokens": 1000})
    assert roomy.state == "running"
    roomy.close()
    # A larger batch later in the run: the need scales with its tokens.
    big = Warmup(dict(CFG, grad_accumulation_steps=2), lines.append, command=_helper("pass"),
                 largest_tokens=1000).start()
    big.after_step({"peak_memory_gb": 0.88, "tokens": 1000})  # 500 a micro-batch: 2 x 1.25 x 0.88 GB
    assert big.ready() and big.proc is None and "about 2.2 GB" in lines[-1]


def test_close_stops_a_running_helper(cache):
    warm = Warmup(CFG, lambda line: None, command=_helper("time.sleep(60)")).start().launch()
    assert not warm.ready()
    tic = time.time()
    warm.close()
    assert time.time() - tic < 10 and warm.proc.returncode is not None
    assert warm.state == "stopped" and not warm.scratch.exists() and not warm.marker.exists()


def test_scratch_of_runs_that_are_gone_is_swept(cache):
    parent = cache / "flash-cce"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, live = parent / f"warmup-{dead.pid}-x", parent / f"warmup-{os.getpid()}-y"
    for d in (gone, live):
        (d / "run").mkdir(parents=True)
    warm = Warmup(CFG, lambda line: None, command=_helper("pass")).start().launch()
    assert not gone.exists() and live.exists()
    warm.close()


def test_the_helper_dies_with_its_run():
    code = "import os, sys; from flash_cce.train.warmup_step import die_with; die_with({}); print('alive')"
    ok = subprocess.run([sys.executable, "-c", code.format(os.getpid())], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "alive"
    orphan = subprocess.run([sys.executable, "-c", code.format(1)], capture_output=True, text=True)
    assert orphan.returncode == 1 and "alive" not in orphan.stdout  # its run already gone


def _settings(tmp_path, iters=4):
    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    argv = ["train", "--model", str(model_dir), "--data", str(data_dir), "--run-dir", str(tmp_path / "run"),
            "--iters", str(iters), "--batch-size", "2", "--num-layers", "-1", "--lora-rank", "4", "--steps-per-eval", "2",
            "--no-progress"]
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config") and not k.startswith("mlx_lm.")}
    return train_settings(flags)


def test_the_helper_trains_one_step_without_checkpoints(tmp_path, cache, monkeypatch):
    """The real helper on the run's settings: one step in its scratch directory, no checkpoint."""
    cfg = _settings(tmp_path)
    kept = []
    monkeypatch.setattr(warmup.shutil, "rmtree", lambda path, **kw: kept.append(path))
    warm = Warmup(cfg, lambda line: None).start().launch()
    assert _wait(warm, timeout=240) and warm.state == "ready", (warm.scratch / "warmup.log").read_text()
    out = (warm.scratch / "warmup.log").read_text()
    assert "Schedule: constant" in out and "1 steps" in out and "Traceback" not in out
    run = warm.scratch / "run"
    assert (run / "config.yaml").exists() and not (run / "checkpoints").exists()
    assert not (run / "adapters").exists() and kept == [warm.scratch]
    assert not (tmp_path / "run").exists()  # the run's own directory untouched
    assert set(ONE_STEP) <= set(settings.BY_NAME)


def test_a_run_switches_to_the_compiled_layers_when_the_helper_is_done(tmp_path, cache, monkeypatch):
    cfg = _settings(tmp_path, iters=8)
    # As on a CUDA GPU with pairs past the threshold; a quick stand-in helper.
    monkeypatch.setattr(stack_plan, "on_cuda", lambda: True)
    monkeypatch.setattr(stack_plan, "COMPILED_FROM_TOKENS", 1)
    monkeypatch.setattr("flash_cce.train.runner.Warmup",
                        lambda cfg, log, **kw: Warmup(cfg, log, command=_helper("time.sleep(0.2)"), **kw))
    plans = []
    real = stack_plan._plan

    def spy(*args):
        plans.append(real(*args))
        if not plans[-1].compiled:
            time.sleep(0.1)  # the steps outlast the helper
        return plans[-1]

    monkeypatch.setattr(stack_plan, "_plan", spy)
    lines = []
    run_train(cfg, log=lines.append, hint=False)
    compiled = [p.compiled for p in plans]
    assert not compiled[0] and compiled[-1]
    switch = compiled.index(True)
    assert all(compiled[switch:]) and not any(compiled[:switch])
    assert any("second process" in str(line) for line in lines)
    assert any("kernels ready after" in str(line) for line in lines)
