"""Build and preload the ``shm_unlink`` shim (``csrc/shm_unlink_shim.c``; recipe §5.5).

PyTorch's CUDA IPC keeps reference-counter files of shared storages in POSIX shared memory (``/torch_*``).
Under load a producer's collection can try to unlink a file the receiver side already removed; the
``ENOENT`` makes PyTorch throw and the trainer rank dies in the middle of a weight sync. The shim, loaded
with ``LD_PRELOAD``, turns exactly that case (``ENOENT`` on a ``/torch_*`` name) into success.

The shim is optional: it is compiled on first use with the system C compiler (``$CC``, else ``cc``) into a
cache directory and reused while the source is unchanged. Without a compiler ``build_shim`` raises
``ShimBuildError`` saying so, and the launcher reports it and runs without the shim.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SHIM_SOURCE", "ShimBuildError", "build_shim", "default_shim_dir", "shim_env"]

SHIM_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "shm_unlink_shim.c"
_LIBRARY_STEM = "libk3_shm_unlink_shim"


class ShimBuildError(RuntimeError):
    """The shim could not be built (no C compiler, or the compiler failed); the message says which."""


def default_shim_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$K3_SHIM_DIR``, else ``$XDG_CACHE_HOME/k3``, else ``~/.cache/k3``."""
    environ = os.environ if environ is None else environ
    if environ.get("K3_SHIM_DIR"):
        return Path(environ["K3_SHIM_DIR"])
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "k3"


def _compiler(environ: Mapping[str, str]) -> str:
    name = environ.get("CC") or "cc"
    path = shutil.which(name)
    if path is None:
        raise ShimBuildError(f"no C compiler: {name!r} is not on PATH (install one, e.g. `apt-get install gcc`, or "
                             "set CC); the shm_unlink shim is optional, run with --no-ipc-unlink-shim to go without")
    return path


def build_shim(out_dir: str | Path | None = None, source: str | Path = SHIM_SOURCE,
               environ: Mapping[str, str] | None = None) -> Path:
    """Compile ``source`` into ``out_dir`` (default ``default_shim_dir()``) and return the shared library's path.

    The file name carries a hash of the source, so an unchanged source is built once and then reused; the
    library is written to a temporary name and renamed into place, so concurrent builders never see half a file.
    Raises ``ShimBuildError`` without a compiler or when compilation fails.
    """
    environ = os.environ if environ is None else environ
    source = Path(source)
    if not source.is_file():
        raise ShimBuildError(f"shim source {source} does not exist")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir is not None else default_shim_dir(environ)
    library = out_dir / f"{_LIBRARY_STEM}-{digest}.so"
    if library.is_file():
        return library
    cc = _compiler(environ)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{_LIBRARY_STEM}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp_name, str(source), "-ldl"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise ShimBuildError(f"{cc} failed to build {source} (exit {result.returncode}):\n{result.stderr.strip()}")
        os.replace(tmp_name, library)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return library


def shim_env(environ: Mapping[str, str] | None = None, library: str | Path | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) with the shim first in ``LD_PRELOAD``.

    ``library`` defaults to ``build_shim()`` (built per ``os.environ``; may raise ``ShimBuildError``). Entries in
    ``LD_PRELOAD`` are kept after it; the shim is not added twice.
    """
    env = dict(os.environ if environ is None else environ)
    path = str(library if library is not None else build_shim())
    # ld.so splits LD_PRELOAD on spaces and colons alike.
    others = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != path]
    env["LD_PRELOAD"] = ":".join([path, *others])
    return env
