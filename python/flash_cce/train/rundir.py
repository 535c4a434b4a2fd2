"""A run directory's state before anything is written: writability, its lock,
its checkpoints; and setting aside what a resume from an older checkpoint replaces.
"""

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from .checkpoint import TRAINER_STATE
from .storage import WriteError, writing

LOCK = "run.lock"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUPERSEDED = "superseded"


class RunDirError(ValueError):
    """The run directory cannot be used as asked."""


def checkpoints(run_dir):
    """The complete checkpoints of `run_dir`, oldest first, as (step, path)."""
    out = []
    for p in sorted((Path(run_dir) / "checkpoints").glob("step-*")):
        if (p / TRAINER_STATE).exists():
            out.append((int(p.name.split("-")[1]), p))
    return out


RUN_FILES = {CONFIG, METRICS, LOCK, SUPERSEDED, "checkpoints", "adapters", "best", "plot.png",
             "adapters.safetensors", "adapter_config.json",  # the latest adapters (checkpoint.link)
             CONFIG + ".tmp", METRICS + ".tmp",
             "reference_logps.npz", "reference_logps.npz.tmp.npz"}  # reference.TABLE


def foreign_files(run_dir):
    """Names in `run_dir` that a run does not write (a fresh run will not mix with them)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES and not p.name.startswith("."))


def has_checkpoints(run_dir):
    return any((Path(run_dir) / "checkpoints").glob("step-*"))


def check_writable(run_dir):
    """RunDirError unless `run_dir` is (or can be made) a writable directory."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir: {str(run_dir)!r} exists and is not a directory")
    probe = run_dir
    while not probe.exists():
        if probe.is_symlink():
            raise RunDirError(f"run_dir: {str(probe)!r} is a broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise RunDirError(f"run_dir: cannot create {str(run_dir)!r}: {str(probe)!r} is not a directory")
    try:  # a real write: permissions, read-only mounts, pseudo file systems, a full disk
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        what = "is not writable" if probe == run_dir else f"cannot be created in {str(probe)!r}"
        raise RunDirError(f"run_dir: {str(run_dir)!r} {what} ({e.strerror})") from None


def pid_alive(pid):
    """Whether process `pid` of this machine exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_owner(run_dir, name=LOCK):
    """(pid, host, alive) of the lock `name` in `run_dir`, or None without one."""
    path = Path(run_dir) / name
    try:
        info = json.loads(path.read_text())
        pid, host = int(info["pid"]), str(info["host"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OSError):
        return (None, None, False)  # unreadable: left by a process killed while writing it
    alive = pid_alive(pid) if host == socket.gethostname() else True
    return pid, host, alive


def check_lock(run_dir, name=LOCK, what="run_dir"):
    """RunDirError when another live process holds the lock `name` in `run_dir`;
    a message when a stale one is left; None when it is free or this process's own."""
    owner = lock_owner(run_dir, name)
    if owner is None:
        return None
    pid, host, alive = owner
    if pid == os.getpid() and host == socket.gethostname():
        return None
    lock = Path(run_dir) / name
    subject = run_dir if name == LOCK else lock.with_name(name.removesuffix(".lock"))
    if alive:
        raise RunDirError(f"{what}: {subject} is in use by process {pid} on {host} (its lock {lock}); "
                          f"wait for it or use another {what}")
    if pid is None:  # an empty or torn file: older versions could leave one on a full disk
        return f"{what}: found an unreadable lock file {lock}; taking it over"
    return f"{what}: found a stale lock of process {pid} (no longer running) in {run_dir}; taking it over"


def _link_or_copy(src, dest):
    """Creates `dest` with `src`'s content, failing when it exists: a hard link, or
    where the file system has none, an exclusive copy removed again if it fails."""
    try:
        os.link(src, dest)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(Path(src).read_bytes())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(dest)
        raise


class Lock:
    """An exclusive lock file holding this process's id; `acquire` takes over a
    stale one. A run directory's lock is `run.lock` in it; `name` locks another
    file (`OUT.lock` beside an output file)."""

    def __init__(self, run_dir, name=LOCK, what="run_dir"):
        self.path = Path(run_dir) / name
        self.what = what
        self.held = False

    def acquire(self):
        # Written whole into a file of its own, then linked into place: the lock
        # never exists empty or torn (a full disk fails before it appears).
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with writing(self.path), open(tmp, "w") as f:
                json.dump(dict(pid=os.getpid(), host=socket.gethostname(), started=time.time()), f)
                f.flush()
                os.fsync(f.fileno())
            for _ in range(2):
                try:
                    with writing(self.path):
                        _link_or_copy(tmp, self.path)
                except WriteError as e:
                    if e.errno != errno.EEXIST:
                        raise
                    if (lock_owner(self.path.parent, self.path.name) or (None,))[0] == os.getpid():
                        raise RunDirError(f"{self.what}: {self.path} is already held by this process") from None
                    check_lock(self.path.parent, self.path.name, self.what)  # raises while its owner lives
                    self.path.unlink(missing_ok=True)
                    continue
                self.held = True
                return self
        finally:
            tmp.unlink(missing_ok=True)
        raise RunDirError(f"{self.what}: could not take the lock {self.path}")

    def release(self):
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def state(run_dir):
    """What the checks before the lock saw of `run_dir`: compared again under the
    lock, so that a command which another one overtook writes nothing."""
    run_dir = Path(run_dir)
    config = run_dir / CONFIG
    return (config.read_bytes() if config.is_file() else None,
            tuple(p.name for p in sorted((run_dir / "checkpoints").glob("step-*"))), foreign_files(run_dir))


def check_unchanged(run_dir, before):
    """RunDirError when `run_dir` is no longer as `state` saw it before the lock."""
    if state(run_dir) != before:
        raise RunDirError(f"run_dir: {run_dir} changed while this command was starting (another command "
                          "wrote to it first); nothing was written; look at it and run the command again")


def set_aside(run_dir, step, best_step, log=print):
    """Moves checkpoints after `step`, and metric records after it, into
    superseded/<stamp>/ (kept, not deleted); points `adapters` at `step` and
    `best` at `best_step` (or removes it when that checkpoint is gone)."""
    from .checkpoint import link, step_dir, unlink

    run_dir = Path(run_dir)
    later = [p for s, p in checkpoints(run_dir) if s > step]
    later += [p for p in (run_dir / "checkpoints").glob(".tmp-step-*")]
    metrics = run_dir / METRICS
    lines = metrics.read_text().splitlines(keepends=True) if metrics.exists() else []
    keep = [ln for ln in lines if ln.strip() and _step_of(ln) <= step]
    drop = [ln for ln in lines if ln.strip() and _step_of(ln) > step]
    if later or drop:
        dest = run_dir / SUPERSEDED / f"after-step-{step:07d}-{time.strftime('%Y%m%d-%H%M%S')}"
        with writing(dest):
            (dest / "checkpoints").mkdir(parents=True, exist_ok=False)
            for p in later:
                shutil.move(str(p), str(dest / "checkpoints" / p.name))
        if drop:
            with writing(dest / METRICS):
                (dest / METRICS).write_text("".join(drop))
            tmp = metrics.with_name(METRICS + ".tmp")
            with writing(metrics):
                tmp.write_text("".join(keep))
                os.replace(tmp, metrics)
        log(f"Moved what came after step {step} ({len(later)} checkpoints, {len(drop)} metric records) to {dest}")
    link(run_dir, "adapters", step_dir(run_dir, step))
    if best_step is not None and step_dir(run_dir, best_step).exists():
        link(run_dir, "best", step_dir(run_dir, best_step))
    else:
        unlink(run_dir, "best")


def _step_of(line):
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line: set aside with what follows the checkpoint


def os_error_line(e, what="run_dir"):
    """One line for an OSError (permissions, disk full, ...)."""
    reason = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        reason = "no space left on the device"
    name = f" {e.filename}" if e.filename else ""
    return f"{what}:{name}: {reason}"
