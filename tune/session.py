"""Where a sweep's Ray runs, and Ctrl-C at any moment of it.

- `sweep_ray`: the Ray this process already joined, or the cluster at `--address` (their own
  session and logs), or an embedded local Ray whose session folder, logs and Tune's trial
  working folders are under OUT/ray. Ray puts its Unix sockets in that folder, whose paths may
  not pass 107 bytes; where OUT is too deep for that, Ray is given a short link in the system's
  temporary folder that points to OUT/ray, so the files still live under OUT.
- `obeyed_interrupt`: around the whole sweep, SIGINT raises KeyboardInterrupt, whatever this
  process inherited. A command started as a background job of a script inherits SIGINT ignored;
  Tune's fit installs a handler of its own regardless, so without this the sweep would obey a
  SIGINT during its trials and ignore one during the confirmation.
- `tune_fit_interrupts`: Tune's fit catches the first SIGINT itself (it ends the fit and saves its
  state) and leaves its own handler installed when no SIGINT came, which would swallow a later
  Ctrl-C. The block says whether a SIGINT came during the fit and puts the handler back.
- `held_interrupt`: files written whole: a SIGINT inside the block is held off, and said.
  `held_from_then`: the same from a moment inside the block to its end (the sweep's end).
- `wait_interruptibly`: `ray.get` of several refs that a Ctrl-C ends even where Ray drops the
  KeyboardInterrupt its native wait raised.
- `pause_point`: a moment of each stage (the patches, a trial, the confirmation, the results,
  leaving Ray, reading what Tune saved) at which a test can interrupt the sweep for certain:
  where FADRM_TUNE_PAUSE names the stage, the process that reaches it makes a file and waits
  there for the SIGINT. Nothing otherwise; a FADRM_TUNE_PAUSE naming no stage is refused
  (`check_pause`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

RAY_DIR = "ray"
# Ray's sockets go to TEMP/session_<date>_<time>_<micro>_<pid>/sockets/plasma_store: 62 bytes
# after TEMP, and an AF_UNIX path holds at most 107.
MAX_TEMP_DIR = 107 - 62


def ray_temp_dir(folder: Path) -> Path | None:
    """The path to give Ray for its session folder in `folder`: `folder` itself where it is
    short enough, else a link to it in the system's temporary folder (made here); None where no
    such link can be made (another user's file holds its name): Ray's default then."""
    if len(str(folder)) <= MAX_TEMP_DIR:
        return folder
    link = Path(tempfile.gettempdir()) / f"fadrm-tune-{hashlib.sha256(str(folder).encode()).hexdigest()[:12]}"
    if len(str(link)) > MAX_TEMP_DIR:
        return None
    try:
        if link.is_symlink() and os.readlink(link) == str(folder):
            return link
        if os.path.lexists(link):
            if link.lstat().st_uid != os.getuid():
                return None
            link.unlink()
        link.symlink_to(folder, target_is_directory=True)
    except OSError:
        return None
    return link


@contextlib.contextmanager
def sweep_ray(out: Path, address: str | None) -> Iterator[Path | None]:
    """The sweep's Ray (module docstring); yields the folder of its sessions (OUT/ray), or None
    where the sessions are not the sweep's (a Ray joined or named, or no link could be made)."""
    import ray

    from actors.coordinator import ray_session

    if address or ray.is_initialized():
        with ray_session(address):
            yield None
        return
    folder = out / RAY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    temp = ray_temp_dir(folder)
    try:
        with ray_session(None, temp_dir=str(temp) if temp is not None else None):
            yield folder if temp is not None else None
    finally:
        if temp is not None and temp != folder:
            with contextlib.suppress(OSError):
                temp.unlink()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def obeyed_interrupt() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt, even where this process inherited it
    ignored (module docstring); the handler of before is put back."""
    if not _main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is not None:  # None: a handler not installed from Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def tune_fit_interrupts() -> Iterator[Callable[[], bool]]:
    """Around `Tuner.fit`: yields a function that tells, after the fit, whether a SIGINT came
    during it (Tune caught it, or it raised here); the SIGINT handler of before is put back."""
    if not _main_thread():
        yield lambda: False
        return
    before = signal.getsignal(signal.SIGINT)
    came = threading.Event()

    def mine(signum, frame):
        came.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, mine)
    try:
        yield came.is_set
    finally:
        # Tune installs its handler over this one and puts this one back when a SIGINT comes.
        if signal.getsignal(signal.SIGINT) is mine:
            came.set()
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def held_interrupt() -> Iterator[Callable[[], bool]]:
    """A SIGINT inside the block is held off (what it writes is written whole); yields a function
    that tells whether one came, for the caller to end the sweep as interrupted or not."""
    with held_from_then() as hold:
        yield hold()


@contextlib.contextmanager
def held_from_then() -> Iterator[Callable[[], Callable[[], bool]]]:
    """Yields `hold`: SIGINT is as it was until `hold()` is called, then held off to the end of the
    block; `hold()` returns a function that tells whether one came since (calling it again holds
    nothing more, and returns the same function). The end of a sweep (writing the files, reading
    what Tune saved, leaving Ray) is not cut short by a second Ctrl-C. Call `hold()` where no
    inner block has a SIGINT handler of its own: that block would put its own "before" back."""
    came, before = threading.Event(), []

    def hold() -> Callable[[], bool]:
        if not before and _main_thread():
            before.append(signal.getsignal(signal.SIGINT))
            signal.signal(signal.SIGINT, lambda signum, frame: came.set())
        return came.is_set

    try:
        yield hold
    finally:
        if before and before[0] is not None:  # None: a handler not installed from Python
            signal.signal(signal.SIGINT, before[0])


def wait_interruptibly(refs: list, poll_s: float = 0.5) -> list:
    """`ray.get(refs)`, ended by Ctrl-C (KeyboardInterrupt) however Ray treats the signal."""
    import ray

    from actors.lifeline import interrupt_mark

    with interrupt_mark() as interrupted:
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
            if interrupted():
                raise KeyboardInterrupt
        return ray.get(list(refs))


PAUSE_ENV = "FADRM_TUNE_PAUSE"
# The patches' task, a trial, the confirmation's task, the driver after writing best.yaml, the
# driver as it leaves Ray (its files written), the driver of an interrupted sweep as it reads
# Tune's saved experiment.
PAUSE_STAGES = ("patches", "trial", "confirmation", "results", "shutdown", "saved")
PAUSE_S = 300.0


def check_pause() -> None:
    """Refuse (InputError, one line) a FADRM_TUNE_PAUSE that is set but is not `STAGE:FILE` with a
    known STAGE, before the sweep starts: a typo would otherwise wait for a pause that never comes."""
    from fadrm_ray.errors import InputError

    value = os.environ.get(PAUSE_ENV, "")
    stage, _, marker = value.partition(":")
    if value and (stage not in PAUSE_STAGES or not marker):
        raise InputError(f"{PAUSE_ENV}={value!r}: give STAGE:FILE, STAGE one of {', '.join(PAUSE_STAGES)}; "
                         f"or unset it")


def pause_point(stage: str, until: Callable[[], bool] = lambda: False) -> None:
    """Where FADRM_TUNE_PAUSE is `STAGE:FILE` and `stage` is STAGE, create FILE, then wait there
    until `until()` (a SIGINT held off, in the driver), until this process ends (a Ray task, which
    the interrupted sweep ends) or a KeyboardInterrupt ends the wait, or PAUSE_S seconds at most.
    Elsewhere, nothing: the moments a test interrupts the sweep at (module docstring)."""
    assert stage in PAUSE_STAGES, stage
    wanted, _, marker = os.environ.get(PAUSE_ENV, "").partition(":")
    if wanted != stage or not marker:
        return
    Path(marker).touch()
    deadline = time.monotonic() + PAUSE_S
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)
