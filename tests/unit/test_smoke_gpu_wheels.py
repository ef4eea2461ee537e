"""ci/prepare_gpu_wheels.py: the wheel folder `make smoke-gpu` carries to a bare GPU host.

The ray wheel is rebuilt without ``ray/jars/``; its RECORD must then list exactly the files left, each with its
sha256 and size (pip and auditors read it). Wheels here are built by the test (small, valid); the real cached ray
wheel is stripped too when this machine has it (/work/whl/ray). The download itself runs through pip with
``--no-index --find-links`` a local folder: the same command the script runs against the index.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prepare_gpu_wheels", ROOT / "ci" / "prepare_gpu_wheels.py")
pgw = importlib.util.module_from_spec(_spec)
sys.modules["prepare_gpu_wheels"] = pgw
_spec.loader.exec_module(pgw)

CACHED_RAY = Path("/work/whl/ray/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl")


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, project: str, version: str, tag: str = "py3-none-any",
               files: dict[str, bytes] | None = None) -> Path:
    """A valid wheel: the files, METADATA, WHEEL and a RECORD with every hash."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(files or {f"{dist}/__init__.py": b"VALUE = 1\n"})
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    py, abi, plat = tag.split("-")
    files[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {str(plat == 'any').lower()}\n"
                              f"Tag: {tag}\n").encode()
    rows = [[name, _hash(data), str(len(data))] for name, data in files.items()]
    rows.append([f"{info}/RECORD", "", ""])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", text.getvalue())
    return path


def fake_ray(folder: Path) -> Path:
    return make_wheel(folder, "ray", "2.60.0", "cp312-cp312-manylinux2014_x86_64", {
        "ray/__init__.py": b"__version__ = '2.60.0'\n",
        "ray/jars/ray_dist.jar": b"\x00" * 5000,
        "ray/jars/sub/more.jar": b"jar",
        "ray/_private/worker.py": b"x = 1\n" * 100,
        "ray-2.60.0.data/scripts/ray": b"#!python\n",
    })


def _rewrite(path: Path, change) -> None:
    """Rewrite a wheel's entries through ``change(name, data) -> data | None`` (None drops the entry)."""
    with zipfile.ZipFile(path) as zf:
        entries = [(n, zf.read(n)) for n in zf.namelist()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries:
            new = change(name, data)
            if new is not None:
                zf.writestr(name, new)


# ---------------------------------------------------------------------------------------------- strip + RECORD
def test_strip_drops_the_folder_and_keeps_a_consistent_record(tmp_path):
    wheel = fake_ray(tmp_path)
    out = tmp_path / "out" / wheel.name
    out.parent.mkdir()
    assert pgw.record_problems(wheel) == []
    dropped, dropped_bytes = pgw.strip_folder(wheel, "ray/jars/", out)
    assert (dropped, dropped_bytes) == (2, 5003)
    assert pgw.record_problems(out) == []
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(out) as b:
        kept = [n for n in a.namelist() if not n.startswith("ray/jars/")]
        assert b.namelist()[:-1] == [n for n in kept if not n.endswith("RECORD")]  # same order, RECORD last
        assert b.namelist()[-1] == "ray-2.60.0.dist-info/RECORD"
        for name in kept:
            if not name.endswith("RECORD"):
                assert b.read(name) == a.read(name)
                assert b.getinfo(name).compress_type == a.getinfo(name).compress_type
        record = b.read("ray-2.60.0.dist-info/RECORD").decode()
    assert "ray/jars" not in record
    assert record.count("\n") == len(kept)


def test_record_problems_name_each_inconsistency(tmp_path):
    wheel = fake_ray(tmp_path)
    original = b"__version__ = '2.60.0'\n"
    _rewrite(wheel, lambda n, d: b"changed\n" if n == "ray/__init__.py" else d)
    assert pgw.record_problems(wheel) == [f"ray/__init__.py: RECORD says {_hash(original)},{len(original)}, the file "
                                          f"is {_hash(b'changed' + bytes([10]))},8"]
    wheel = fake_ray(tmp_path)
    _rewrite(wheel, lambda n, d: None if n == "ray/_private/worker.py" else d)
    assert pgw.record_problems(wheel) == ["ray/_private/worker.py: in RECORD, not in the wheel"]
    wheel = fake_ray(tmp_path)
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("ray/extra.py", b"")
    assert pgw.record_problems(wheel) == ["ray/extra.py: in the wheel, not in RECORD"]


def test_strip_refuses_what_it_cannot_do(tmp_path):
    wheel = fake_ray(tmp_path)
    with pytest.raises(ValueError, match="ending in '/'"):
        pgw.strip_folder(wheel, "ray/jars", tmp_path / "x.whl")
    with pytest.raises(ValueError, match="out must differ"):
        pgw.strip_folder(wheel, "ray/jars/", wheel)
    out = tmp_path / "o1.whl"
    pgw.strip_folder(wheel, "ray/jars/", out)
    with pytest.raises(pgw.WheelError, match="nothing to strip"):
        pgw.strip_folder(out, "ray/jars/", tmp_path / "o2.whl")


def test_strip_ray_in_place_is_idempotent(tmp_path):
    wheel = fake_ray(tmp_path)
    assert "dropped 2 file(s)" in pgw.strip_ray(tmp_path)
    assert pgw.record_problems(wheel) == [] and not pgw._has_folder(wheel, "ray/jars/")
    assert "already without" in pgw.strip_ray(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]  # no temporary left behind


@pytest.mark.slow
@pytest.mark.skipif(not CACHED_RAY.is_file(), reason="the cached ray 2.60.0 wheel is not on this machine")
def test_the_real_ray_wheel_rebuilt_without_its_jars(tmp_path):
    out = tmp_path / CACHED_RAY.name
    dropped, dropped_bytes = pgw.strip_folder(CACHED_RAY, "ray/jars/", out)
    assert dropped >= 1 and dropped_bytes > 30 * 1024**2
    assert pgw.record_problems(out) == []
    with zipfile.ZipFile(out) as zf:
        assert not [n for n in zf.namelist() if n.startswith("ray/jars/")]
    assert out.stat().st_size < 48 * 1024**2  # 79 MB -> 47 MB (issue #21)


# ---------------------------------------------------------------------------------------------- the folder
def _cache(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in pgw.WHEELS:
        if name == "ray":
            fake_ray(folder)
        else:
            make_wheel(folder, name, version)
    return folder


def test_project_names_are_normalized():
    assert pgw.project_of("rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl") == "rpds-py"
    assert pgw.project_of("jsonschema_specifications-2025.9.1-py3-none-any.whl") == "jsonschema-specifications"
    assert pgw.project_of("torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl") == "torch-memory-saver"


def test_download_command_is_the_pinned_no_deps_binary_download(tmp_path):
    cmd = pgw.download_command(tmp_path, "py", skip=frozenset({"ray"}))
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert [cmd[i + 1] for i, w in enumerate(cmd) if w == "--platform"] == list(pgw.PLATFORMS)
    assert "manylinux2014_x86_64" in pgw.PLATFORMS
    pins = [w for w in cmd if "==" in w]
    assert pins == [f"{n}=={v}" for n, v in pgw.WHEELS if n != "ray"]
    assert {"fla-core==0.6.0", "flash-linear-attention==0.6.0", "megatron-core==0.16.1",
            "torch-memory-saver==0.0.10"} <= set(pins)
    assert "ray==2.60.0" in pgw.download_command(tmp_path)


def test_check_folder_names_every_problem(tmp_path):
    _cache(tmp_path)
    with pytest.raises(pgw.WheelError, match="ray-2.60.0-.*still holds ray/jars/"):
        pgw.check_folder(tmp_path)
    pgw.strip_ray(tmp_path)
    summary = pgw.check_folder(tmp_path)
    assert list(summary.wheels) == [n for n, _ in pgw.WHEELS]
    assert summary.total_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.whl"))
    make_wheel(tmp_path, "referencing", "0.36.2")
    (tmp_path / "fla_core-0.6.0-py3-none-any.whl").unlink()
    make_wheel(tmp_path, "numpy", "2.0.0")
    with pytest.raises(pgw.WheelError) as e:
        pgw.check_folder(tmp_path)
    text = str(e.value)
    assert "fla-core==0.6.0: no wheel" in text
    assert "referencing: 2 wheels" in text and "keep one" in text
    assert "numpy-2.0.0-py3-none-any.whl" in text


def test_main_downloads_strips_and_reports_the_size(tmp_path, capsys):
    cache = _cache(tmp_path / "cache")
    dest = tmp_path / "whl"
    assert pgw.main(["--dest", str(dest), "--find-links", str(cache), "--no-index"]) == 0
    out = capsys.readouterr().out
    assert "pip download" in out and "--no-deps" in out
    assert "RECORD consistent" in out
    assert "9 wheels" in out and "MiB of the 64 MiB a device call carries" in out
    ray = next(dest.glob("ray-*.whl"))
    assert pgw.record_problems(ray) == [] and not pgw._has_folder(ray, "ray/jars/")
    # Again: the stripped ray wheel stays; pip is not asked for it.
    assert pgw.main(["--dest", str(dest), "--find-links", str(cache), "--no-index"]) == 0
    out = capsys.readouterr().out
    assert "ray==2.60.0" not in out and "already without ray/jars/" in out


def test_main_fails_over_the_limit(tmp_path, capsys, monkeypatch):
    cache = _cache(tmp_path / "cache")
    monkeypatch.setattr(pgw, "LIMIT_BYTES", 1000)
    assert pgw.main(["--dest", str(tmp_path / "whl"), "--find-links", str(cache), "--no-index"]) == 1
    assert "over 0 MiB" in capsys.readouterr().err


def test_main_refuses_a_folder_with_foreign_wheels(tmp_path, capsys):
    dest = tmp_path / "whl"
    dest.mkdir()
    make_wheel(dest, "numpy", "2.0.0")
    assert pgw.main(["--dest", str(dest), "--no-index"]) == 1
    assert "outside the set: numpy-2.0.0" in capsys.readouterr().err
