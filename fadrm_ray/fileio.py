"""Files that are either complete or absent: atomic writes, content hashes, output checks.

Everything the project writes for others to read (checkpoints, part files, manifests) goes
through `atomic_write_bytes`, so a crash never leaves a half-written file under its final name.
Outputs a user names (an export, a teacher) go through `atomic_create_bytes`, which also never
replaces a file that is already there, and are checked by `check_output_dir` /
`check_new_output` before any work starts, so a bad location costs one line, not a run.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fadrm_ray.errors import InputError

if TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")


class OutputError(InputError):
    """An output location that cannot be written, or an output that would replace existing data."""


CACHE_ENV = "FADRM_CACHE"


def cache_root() -> Path:
    """The machine's cache of this project: $FADRM_CACHE, default ~/.cache/fadrm (folder
    listings, built datasets, pilots)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/fadrm").expanduser()


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
    tmp = _temp_beside(path)
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        _name(exc, path)
        raise
    fsync_dir(path.parent)
    return path


def _temp_beside(path: Path) -> Path:
    """A new hidden temporary name in `path`'s directory (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _write_synced(tmp: Path, data: bytes) -> None:
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _name(exc: BaseException, path: Path) -> None:
    """Let a failed write say which file it was ("No space left on device" alone does not)."""
    if isinstance(exc, OSError) and not exc.filename:
        exc.filename = str(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_create_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Like `atomic_write_bytes`, but refuse (FileExistsError) if ``path`` already exists.

    The complete file is linked to its final name: a link never replaces an existing name, so
    two writers racing for one name cannot overwrite each other and no check-then-write gap opens.
    """
    path = Path(path)
    tmp = _temp_beside(path)
    try:
        _write_synced(tmp, data)
        os.link(tmp, path)
    except OSError as exc:
        _name(exc, path)
        raise
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
    fsync_dir(path.parent)
    return path


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path.cwd()


def probe_writable(directory: Path, *, write_byte: bool = False) -> str | None:
    """Why a file cannot be created in `directory` (with `write_byte`, given one byte: a full disk
    or quota still lets a file be created), or None if it can.

    A real file is created and removed, whatever fails: permission bits say nothing on a read-only
    mount, for root, or under NFS root squashing, and a failed write after hours of work costs far
    more. Nothing is left behind, however often it is asked (the service asks every second).
    """
    probe = directory / f".fadrm-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc)
    try:
        if write_byte:
            os.write(fd, b"\0")
        return None
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            probe.unlink()


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Raise OutputError unless `path` is a directory, or can be created as one, that this process
    can write to. Nothing is created: a refused command leaves nothing behind."""
    path = Path(path)
    existing = _nearest_existing(path)
    if not existing.is_dir():
        if existing == path:
            raise OutputError(f"{what} {path} is a file, not a directory")
        raise OutputError(f"{what} {path} cannot be created: {existing} is a file, not a directory")
    reason = probe_writable(existing)
    if reason is not None:
        where = "" if existing == path else f" (in {existing})"
        raise OutputError(f"{what} {path} is not writable{where}: {reason}")
    return path


def check_new_output(path: str | os.PathLike, what: str, *, empty_dir_ok: bool = False) -> Path:
    """Raise OutputError if `path` exists (an empty directory passes with `empty_dir_ok`), or if
    its folder cannot be written (`check_output_dir`)."""
    path = Path(path)
    if os.path.lexists(path):
        if not (empty_dir_ok and path.is_dir() and not any(path.iterdir())):
            raise OutputError(f"{what} {path} already exists; choose a new path or remove it first")
        check_output_dir(path, what)
        return path
    check_output_dir(path.parent, f"the folder of {what}")
    return path



def read_yaml_mapping(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> dict:
    """The mapping a YAML file holds (an empty file is an empty mapping), or `error` with one line
    naming `what` the file is (e.g. "config file x.yaml"): missing, not YAML, or not a mapping."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise error(f"{what}: not YAML ({exc.__class__.__name__})") from None
    if not isinstance(loaded, dict):
        raise error(f"{what} must hold a mapping of key: value")
    return loaded


def read_model(model: type[M], path: str | os.PathLike) -> M | None:
    """`model` read from the JSON file `path`, or None when it is missing, unreadable or not one."""
    try:
        return model.model_validate_json(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
