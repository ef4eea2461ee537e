"""The shm_unlink shim (csrc/shm_unlink_shim.c, recipe §5.5): reproduce the CUDA-IPC failure without it — an
``shm_unlink`` of an already-removed ``/torch_*`` file through libc fails with ENOENT — show it tolerated with
it, other names still failing, real segments still removed; and the launcher flag that preloads it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from k3.launch.args import TrainArgs, resolve
from k3.transport.shim import SHIM_SOURCE, ShimBuildError, build_shim, shim_env

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")

# Calls libc's shm_unlink the way PyTorch's libshm does; prints "rc errno" for each name on argv.
_UNLINK = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    for name in sys.argv[1:]:
        ctypes.set_errno(0)
        rc = libc.shm_unlink(name.encode())
        print(rc, ctypes.get_errno())
""")


def _unlink(names: list[str], env: dict[str, str]) -> list[tuple[int, int]]:
    out = subprocess.run([sys.executable, "-c", _UNLINK, *names], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    return build_shim(tmp_path_factory.mktemp("shim"))


def _gone(tag: str) -> str:
    name = f"/torch_{os.getpid()}_{tag}_gone"
    assert not os.path.exists("/dev/shm" + name)
    return name


@needs_cc
def test_without_the_shim_an_already_removed_torch_file_is_enoent():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert _unlink([_gone("plain")], env) == [(-1, errno.ENOENT)]


@needs_cc
def test_with_the_shim_it_is_tolerated_and_other_names_still_fail(shim):
    env = shim_env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, library=shim)
    other = f"/other_{os.getpid()}_gone"
    assert _unlink([_gone("shim"), other], env) == [(0, 0), (-1, errno.ENOENT)]


@needs_cc
def test_with_the_shim_a_real_segment_is_still_unlinked(shim):
    name = f"/torch_{os.getpid()}_real"
    path = "/dev/shm" + name
    with open(path, "wb") as f:  # a POSIX shm object is a file in /dev/shm on Linux
        f.write(b"x" * 64)
    try:
        env = shim_env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, library=shim)
        # second call: the file is gone now, which is the tolerated case
        assert _unlink([name, name], env) == [(0, 0), (0, 0)]
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# PyTorch's own path: a file_system-shared storage whose /dev/shm file another party already removed. Freeing it
# runs RefcountedMapAllocator::close -> shm_unlink -> ENOENT -> c10::Error thrown from a destructor: abort.
_TORCH_FREE = textwrap.dedent("""
    import gc, os, torch, torch.multiprocessing as mp
    mp.set_sharing_strategy("file_system")
    t = torch.zeros(1000).share_memory_()
    for n in os.listdir("/dev/shm"):
        if n.startswith(f"torch_{os.getpid()}_"):
            os.unlink("/dev/shm/" + n)
    del t
    gc.collect()
    print("freed")
""")


@needs_cc
def test_torch_aborts_on_the_race_without_the_shim_and_survives_with_it(shim):
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    died = subprocess.run([sys.executable, "-c", _TORCH_FREE], env=plain, capture_output=True, text=True, timeout=60)
    assert died.returncode != 0 and "freed" not in died.stdout
    assert "could not unlink the shared memory file /torch_" in died.stderr  # the recipe's symptom
    lived = subprocess.run([sys.executable, "-c", _TORCH_FREE], env=shim_env(plain, library=shim),
                           capture_output=True, text=True, timeout=60)
    assert (lived.returncode, lived.stdout) == (0, "freed\n"), lived.stderr


@needs_cc
def test_build_is_cached_and_keyed_by_the_source(tmp_path, shim):
    again = build_shim(shim.parent)
    assert again == shim and again.stat().st_mtime_ns == shim.stat().st_mtime_ns  # reused, not rebuilt
    changed = tmp_path / "shim.c"
    changed.write_text(SHIM_SOURCE.read_text() + "\n/* changed */\n")
    other = build_shim(shim.parent, source=changed)
    assert other != shim and other.is_file()
    assert sorted(p.name for p in shim.parent.iterdir()) == sorted([shim.name, other.name])  # no temp left


def test_a_missing_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(ShimBuildError, match=r"no C compiler: 'no-such-cc-k3' is not on PATH.*--no-ipc-unlink-shim"):
        build_shim(tmp_path, environ={"CC": "no-such-cc-k3", "PATH": os.environ.get("PATH", "")})
    assert list(tmp_path.iterdir()) == []


def test_a_failing_compile_names_the_source(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "bad.c"
    bad.write_text("int shm_unlink(const char *n) { return }\n")
    with pytest.raises(ShimBuildError, match=r"failed to build .*bad\.c \(exit 1\)"):
        build_shim(tmp_path / "out", source=bad)
    assert list((tmp_path / "out").iterdir()) == []


def test_shim_env_puts_the_shim_first_once():
    env = shim_env({"LD_PRELOAD": "/a.so /lib/shim.so:/b.so", "X": "1"}, library="/lib/shim.so")
    assert env == {"LD_PRELOAD": "/lib/shim.so:/a.so:/b.so", "X": "1"}
    assert shim_env({}, library="/lib/shim.so") == {"LD_PRELOAD": "/lib/shim.so"}


# ---------------------------------------------------------------------- the launcher flag
def test_flag_defaults_on_with_gpus_off_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_SHIM_DIR", str(tmp_path))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cpu = resolve(TrainArgs(run_id="t", model_variant="tiny", hf_checkpoint="/x"))
    assert cpu.args.ipc_unlink_shim is False and "LD_PRELOAD" not in cpu.env
    forced = resolve(TrainArgs(run_id="t", model_variant="tiny", hf_checkpoint="/x", ipc_unlink_shim=False))
    assert "LD_PRELOAD" not in forced.env
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    gpu = resolve(TrainArgs(run_id="t"))  # 4layer: 8 GPUs
    assert gpu.args.ipc_unlink_shim is True
    assert gpu.env["LD_PRELOAD"] == str(build_shim(tmp_path)) and gpu.notes == ()
    on_cpu = resolve(TrainArgs(run_id="t", model_variant="tiny", hf_checkpoint="/x", ipc_unlink_shim=True))
    assert on_cpu.env["LD_PRELOAD"] == gpu.env["LD_PRELOAD"]
    assert resolve(TrainArgs(run_id="t", ipc_unlink_shim=False)).env.get("LD_PRELOAD") is None


def test_flag_without_a_compiler_is_a_note_not_a_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_SHIM_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc-k3")
    r = resolve(TrainArgs(run_id="t"))
    assert r.args.ipc_unlink_shim is False and "LD_PRELOAD" not in r.env
    assert len(r.notes) == 1 and r.notes[0].startswith("--ipc-unlink-shim is off: no C compiler")
