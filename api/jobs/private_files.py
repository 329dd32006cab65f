"""Files the service writes for itself and its clients: owner-only (0600) and atomic.

Job records, driver logs, outcomes and the files a job serves can tell one user what another
asked for, so each is created with mode 0600 by the call that creates it, whatever the process
umask is. Each write goes to a hidden temporary name beside the target and is renamed over it,
so a reader sees the old file or the complete new one.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator

from fadrm_ray.fileio import fsync_dir

PRIVATE = 0o600


@contextlib.contextmanager
def private_output(path: Path) -> Iterator[Path]:
    """A hidden temporary file beside `path`, created 0600, for the block to write (by name); on a
    clean exit it is synced and renamed over `path`, on an error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def private_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` atomically, the file mode 0600."""
    with private_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def private_append(path: Path) -> int:
    """A file descriptor appending to `path`, created 0600 when it is new (a driver's log)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE)
    os.fchmod(fd, PRIVATE)  # a log an earlier version created with the umask's mode
    return fd


def make_private(path: Path) -> Path:
    """Mode 0600 for a file some other writer (zipfile, an image library) created."""
    os.chmod(path, PRIVATE)
    return path
