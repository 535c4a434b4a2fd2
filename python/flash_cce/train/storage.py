"""A run's file writes: a write that fails (a full disk, an I/O error, a read-only
file system, a file size limit) becomes one `WriteError` naming the file."""

import errno
from contextlib import contextmanager

REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "input/output error",
    errno.EFBIG: "file too large for this process's file size limit",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class WriteError(OSError):
    """A file of the run could not be written."""

    def __init__(self, path, reason, code=errno.EIO):
        super().__init__(code, reason, str(path))

    def __str__(self):
        return f"cannot write {self.filename}: {self.strerror}"


@contextmanager
def writing(path):
    """Turns a failed write inside the block into a WriteError naming `path`."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(path, REASONS.get(e.errno, e.strerror or str(e)), e.errno or errno.EIO) from None
    except RuntimeError as e:  # MLX's file writes say only that the write failed
        detail = (str(e).strip().splitlines() or [""])[0]
        raise WriteError(path, f"the write failed ({detail}; a full disk, a read-only file system or "
                               "a file size limit?)") from None
