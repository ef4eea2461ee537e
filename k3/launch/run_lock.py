"""One owner per run directory: an exclusive ``fcntl.flock`` on ``<run_dir>/run.lock``, held for the run's life.

``k3 train`` takes the lock before it writes anything into the directory (the directory itself and this file
are the only things made first), and keeps its file descriptor open until the process ends: the kernel drops
the lock when the process dies, ``kill -9`` included, so a stale lock never blocks a ``--resume``. The holder
writes ``pid=<pid> host=<hostname>`` into the file, so a second ``k3 train`` into the same directory is refused
naming them. ``flock`` is advisory and local: two hosts sharing the directory over NFS are not kept apart.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

__all__ = ["LOCK_NAME", "RunDirectoryBusy", "RunLock", "holder_of", "refuse_if_held"]

LOCK_NAME = "run.lock"


class RunDirectoryBusy(RuntimeError):
    """Another live process holds the run directory's lock; the message names its pid and host."""


class RunLock:
    """The held lock of one run directory. :meth:`acquire` takes it; :meth:`release` (or process exit) drops it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: str | Path) -> "RunLock":
        """Create ``run_dir`` if needed and take its lock without waiting; raises :class:`RunDirectoryBusy`."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirectoryBusy(_busy_message(run_dir, path)) from None
        # Ours now: say who holds it (a reader of a half-written file sees "unknown", never a wrong holder).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would let a third process lock a new inode meanwhile)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_of(run_dir: str | Path) -> str | None:
    """``"pid P on host H"`` of the live process that holds ``run_dir``'s lock, or None when nobody does.
    Writes nothing (a ``--dry-run`` asks this): a directory or lock file that does not exist is not held."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):  # no lock there (a file on the way: no directory either)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return _holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_if_held(run_dir: str | Path) -> None:
    """Raise :class:`RunDirectoryBusy` when a live process holds ``run_dir``'s lock (writes nothing)."""
    run_dir = Path(run_dir)
    if holder_of(run_dir) is not None:
        raise RunDirectoryBusy(_busy_message(run_dir, run_dir / LOCK_NAME))


def _holder(path: Path) -> str:
    try:
        fields = dict(w.split("=", 1) for w in path.read_text().split() if "=" in w)
    except OSError:
        fields = {}
    return f"pid {fields.get('pid', 'unknown')} on host {fields.get('host', 'unknown')}"


def _busy_message(run_dir: Path, path: Path) -> str:
    return (f"--run-dir {run_dir} is in use by another k3 train ({_holder(path)}, lock {path}): wait for it to "
            "end or stop it, or choose another --run-dir")
