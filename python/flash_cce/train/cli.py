"""`flash-cce`: train, eval, plot and demo sub-commands.

Settings come from flags > `--config` YAML > defaults, as in `mlx_lm.lora`; YAML
keys are the flags' names with underscores (see `flash_cce.train.settings`). Errors
are one line on stderr with exit status 2; a run stopped by non-finite steps exits
with 3, an interrupted run with 130.
"""

import argparse
import importlib.util
import os
import signal
import sys
import time

from . import settings


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-flash-cce")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        from .. import __version__

        return __version__


def build_parser():
    fmt = argparse.ArgumentDefaultsHelpFormatter
    from . import mlx_lm_config

    parser = settings.Parser(prog="flash-cce",
                             description="Preference fine-tuning of mlx-lm models with a flash-CCE head.",
                             epilog=mlx_lm_config.train_summary(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flash-cce {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=settings.Parser)

    t = sub.add_parser("train", help="Fine-tune a model on preference pairs.")
    t.add_argument("-c", "--config", default=None, help="YAML file with any of the settings below.")
    settings.add_flags(t, "train")
    mlx_lm_config.add_flags(t)

    e = sub.add_parser("eval", help="Objective loss and preference accuracy of a model (and adapters) on a split.")
    e.add_argument("run", nargs="?", default=None,
                   help="A run directory, its adapters or best, a checkpoint or an mlx_lm adapter directory: "
                        "model and objective settings come from the run.")
    e.add_argument("-c", "--config", default=None, help="YAML file with any of the settings below.")
    e.add_argument("--adapter-path", default=None, help="Same as RUN.")
    e.add_argument("--split", default="test", choices=["train", "valid", "test"], help="(default: test)")
    settings.add_flags(e, "eval")

    p = sub.add_parser("plot", help="PNG of a run's curves.", formatter_class=fmt)
    p.add_argument("run_dir")
    p.add_argument("--output", default=None, help="PNG path (default RUN_DIR/plot.png).")

    _add_spin(sub)

    d = sub.add_parser("demo", help="Train a tiny model offline and watch preference accuracy rise.",
                       formatter_class=fmt)
    d.add_argument("--run-dir", default="flash-cce-demo")
    d.add_argument("--iters", type=settings.flag_type(settings.BY_NAME["iters"]), default=None,
                   help="Optimizer steps (default: the demo's 150; grpo's 300).")
    d.add_argument("--objective", default="orpo", choices=("orpo", "grpo"),
                   help="orpo: preference pairs; grpo: online RL with a verifiable reward.")
    return parser


def _add_spin(sub):
    from .spin import SpinSettings

    d = SpinSettings()
    p = sub.add_parser("spin", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="Self-play pairs: single-answer data -> preference pairs whose rejected "
                            "answer is the model's own generation.")
    p.add_argument("--model", required=True, help="Local mlx-lm model directory (or a Hugging Face id when online).")
    p.add_argument("--adapter-path", default=None, help="Adapters to generate with.")
    p.add_argument("--data", required=True, help="JSONL with prompt and completion, or messages.")
    p.add_argument("--out", required=True, help="Preference pairs JSONL to write (continued when interrupted).")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="Longest generation.")
    p.add_argument("--temp", type=float, default=d.temp, help="Sampling temperature (0: greedy).")
    p.add_argument("--top-p", type=float, default=d.top_p, help="Nucleus sampling mass (1: off).")
    p.add_argument("--min-p", type=float, default=d.min_p, help="Min-p sampling (0: off).")
    p.add_argument("--top-k", type=int, default=d.top_k, help="Top-k sampling (0: off).")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="Prompts generated together.")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chat-template", type=settings.flag_type(settings.BY_NAME["chat_template"]),
                   default=d.chat_template, help="As flash-cce train's chat_template.")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--restart", action="store_true",
                   help="Make an existing --out anew (default: continue it when its progress file "
                        "records the same data, model, adapters and sampling settings, else refuse).")


def _spin(args, log=print):
    from pathlib import Path

    from .preflight import load_model, model_ref
    from .rundir import Lock, check_lock
    from .spin import SpinSettings, check_progress, progress_key, spin

    s = SpinSettings(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                     top_k=args.top_k, batch_size=args.batch_size, seed=args.seed,
                     chat_template=args.chat_template)
    s.validate()
    if not Path(args.data).is_file():
        raise ValueError(f"data: no such file {args.data!r}")
    out = Path(args.out)
    key = progress_key(args.data, s, model_ref(args.model), args.adapter_path)
    check_progress(out, key, args.restart)  # before the model loads; again under the lock
    lock = (out.name + ".lock", "out")
    stale = check_lock(out.parent, *lock)
    model, tokenizer = load_model({"model": args.model, "trust_remote_code": args.trust_remote_code})
    if args.adapter_path:
        from mlx_lm.tuner.utils import load_adapters

        model = load_adapters(model, args.adapter_path)
    model.eval()
    if stale:
        log(stale)
    with Lock(out.parent, *lock):
        spin(model, tokenizer, args.data, out, s, log=log, progress=args.progress, key=key, restart=args.restart)


# MLX_MAX_MB_PER_BUFFER for training on NVIDIA GPUs: MLX frees a kernel's inputs
# only once its CUDA graph has run, so smaller graphs lower the step's peak
# memory, at little cost in time down to this size (docs/stack.md).
GRAPH_MB = "40"


def _set_graph_limit(command):
    """`GRAPH_MB` for train and eval on Linux (MLX's GPU backend there is CUDA;
    its CPU backend does not read the variable) unless MLX_MAX_MB_PER_BUFFER is
    set. MLX reads it when it creates its GPU stream, at import, so this runs
    before anything imports MLX; where MLX is already imported it changes nothing."""
    if command in ("train", "eval") and sys.platform.startswith("linux") and "mlx.core" not in sys.modules:
        os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", GRAPH_MB)


def _restart_with_capture_enabled(argv):
    """Runs this command again with MTL_CAPTURE_ENABLED=1 (Metal reads it when MLX
    opens the device, at import) on a Metal device; elsewhere validation says why not."""
    import mlx.core as mx

    if os.environ.get("MTL_CAPTURE_ENABLED") == "1" or not mx.metal.is_available():
        return
    os.environ["MTL_CAPTURE_ENABLED"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "flash_cce.train.cli", *argv])


def _settings_flags(args):
    return {k: v for k, v in vars(args).items()
            if k not in ("command", "config", "run", "adapter_path", "split")}


def _train(args, argv, log=print):
    from .grpo_trainer import run_grpo
    from .mlx_lm_config import from_flags
    from .runner import run_train, train_settings

    cfg = train_settings(from_flags(_settings_flags(args)), args.config)
    if cfg["gpu_capture"]:  # from a flag or the YAML file
        _restart_with_capture_enabled(argv)
    tic = time.perf_counter()
    # grpo (online RL) runs its own loop, with the same checks, lock and resume
    (run_grpo if cfg["objective"] == "grpo" else run_train)(cfg, log=log)
    log(f"Done in {time.perf_counter() - tic:.1f} s")


def _eval(args, log=print):
    from .evaluation import eval_settings, run_eval
    from .preflight import RunError

    if args.run and args.adapter_path and args.run != args.adapter_path:
        raise RunError("adapter_path: give the run either as RUN or as --adapter-path, not both")
    cfg, adapters = eval_settings(_settings_flags(args), args.config, args.run or args.adapter_path)
    run_eval(cfg, adapters, args.split, log=log)


def _plot(args):
    """A plot into the run directory takes its lock (a live run there writes its own)."""
    from pathlib import Path

    from .plot import plot_run
    from .rundir import Lock, RunDirError

    if args.output is not None or not Path(args.run_dir).is_dir():
        print(plot_run(args.run_dir, args.output))
        return
    try:
        lock = Lock(args.run_dir).acquire()
    except RunDirError as e:
        raise RunDirError(f"{e}; or plot it elsewhere with --output FILE") from None
    try:
        print(plot_run(args.run_dir, args.output))
    finally:
        lock.release()


def _run(args, argv):
    if args.command == "plot":
        _plot(args)
    elif args.command == "demo":
        from .demo import run_demo
        from .grpo_demo import run_grpo_demo

        (run_grpo_demo if args.objective == "grpo" else run_demo)(args.run_dir, iters=args.iters)
    elif args.command == "spin":
        _spin(args)
    elif args.command == "train":
        _train(args, argv)
    else:
        _eval(args)


TRAIN_EXTRA = ("mlx_lm", "yaml", "tqdm", "tokenizers")
NONFINITE_EXIT = 3  # a run stopped by max_nonfinite_steps


def main(argv=None):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    missing = [m for m in TRAIN_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        return _error(args.command, f"needs the train extra ({', '.join(missing)} missing): "
                                    "pip install 'mlx-flash-cce[train]'")
    _set_graph_limit(args.command)
    from .checkpoint import Interrupted, NonFinite
    from .storage import WriteError

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        _run(args, argv)
        return 0
    except Interrupted as e:
        print(f"flash-cce {args.command}: interrupted after step {e.step}; checkpoint {e.ckpt}. "
              f"Resume with: {getattr(e, 'resume_command', 'flash-cce train --resume RUN_DIR')}",
              file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"flash-cce {args.command}: interrupted; nothing written since the last checkpoint",
              file=sys.stderr)
        return 130
    except NonFinite as e:
        where = (f"the last checkpoint with a finite loss is {e.ckpt} (adapters holds it); resume from it "
                 f"with a lower learning_rate or max_grad_norm: flash-cce train --resume {e.ckpt} "
                 "--learning-rate LR") if e.ckpt else "no checkpoint gave a finite loss"
        print(f"flash-cce {args.command}: error: stopped after step {e.step}: {e.streak} non-finite steps "
              f"in a row ({e.detail}; max_nonfinite_steps {e.streak}); {where}", file=sys.stderr)
        return NONFINITE_EXIT
    except WriteError as e:  # a full disk, an I/O error, a read-only file system
        return _error(args.command, str(e))
    except ValueError as e:  # settings, data, run dir, model: one line each
        return _error(args.command, " ".join(str(e).split("\n")))
    except OSError as e:  # permissions, disk full, ...
        from .rundir import os_error_line

        return _error(args.command, os_error_line(e, "file"))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # before training starts: stop as Ctrl-C does


def _error(command, message):
    print(f"flash-cce {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
