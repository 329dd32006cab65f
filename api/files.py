"""Files the service writes for itself and its clients: owner-only (0600) and atomic.

Job records, driver logs, outcomes and the files a job serves can tell one user what another
asked for, so each is created with mode 0600 by the call that creates it, whatever the process
umask is. Each write goes to a hidden temporary name beside the target and is renamed over it,
so a reader sees the old file or the complete new one.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from fadrm_ray.fileio import fsync_dir

PRIVATE = 0o600


def private_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` atomically, the file mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def private_append(path: Path) -> int:
    """A file descriptor appending to `path`, created 0600 when it is new (a driver's log)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE)
    os.fchmod(fd, PRIVATE)  # a log an earlier version created with the umask's mode
    return fd


def make_private(path: Path) -> Path:
    """Mode 0600 for a file some other writer (zipfile, an image library) created."""
    os.chmod(path, PRIVATE)
    return path
