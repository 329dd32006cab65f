"""Files that are either complete or absent: atomic writes and content hashes.

Everything the project writes for others to read (checkpoints, part files, manifests) goes
through `atomic_write_bytes`, so a crash never leaves a half-written file under its final name.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries to disk, after a rename into it (best effort: not every
    platform or file system allows it)."""
    # The rename itself lives in the directory entry; without this a power loss can undo it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that ``path`` is either the old file or the complete new one.

    The temporary file is in the same directory (a rename across file systems is not atomic)
    and starts with a dot so that part-file globs never pick it up.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
