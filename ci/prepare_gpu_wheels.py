#!/usr/bin/env python3
"""Fill a wheel folder with what a bare GPU host needs to run `make smoke-gpu`, on a machine with internet.

The GPU host has Python 3.12, a CUDA torch and Triton, the packages of its image (numpy, transformers, safetensors,
typer, rich, tqdm, psutil, matplotlib, aiohttp, grpcio, protobuf, pyyaml, requests, click, msgpack, einops, ...),
and no way to download anything. The rest arrives as wheels, carried with the working tree (64 MiB in all, the
tree included):

- fla-core + flash-linear-attention 0.6.0 (the trainer's KDA kernels), megatron-core 0.16.1 (the trainer),
  torch-memory-saver 0.0.10 (the trainer's sleep);
- ray 2.60.0, rebuilt without ``ray/jars/`` (the Java worker: 34.5 MB of the 79 MB wheel, which the project never
  starts; 47 MB without it), and the four packages ray needs that the image lacks: jsonschema,
  jsonschema-specifications, referencing, rpds-py.

The project's other dependencies are on the image (see above) or not imported on the smoke's path
(compressed-tensors: the checkpoint is BF16; math-verify: the smoke's reward is deterministic_random).

    python3 ci/prepare_gpu_wheels.py                  # downloads into .whl/ (git-ignored)
    python3 ci/prepare_gpu_wheels.py --dest DIR --find-links CACHE --no-index   # from a local wheel cache

Every wheel is downloaded with ``pip download --no-deps --only-binary=:all: --python-version 3.12`` for the
manylinux x86-64 platforms, pinned (one version of each: two of one package stop the whole install on the host).
The rebuilt ray wheel keeps its file name; its ``RECORD`` lists exactly the files left, with their hashes.
Exit 0 when the folder holds every wheel and fits the limit (the total size is printed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "WHEELS",
    "PLATFORMS",
    "LIMIT_BYTES",
    "RAY_DROPPED_FOLDER",
    "strip_folder",
    "record_problems",
    "project_of",
    "download_command",
    "main",
]

# (project, version): what `make smoke-gpu` installs on the host.
WHEELS: tuple[tuple[str, str], ...] = (
    ("fla-core", "0.6.0"),
    ("flash-linear-attention", "0.6.0"),
    ("megatron-core", "0.16.1"),
    ("torch-memory-saver", "0.0.10"),
    ("ray", "2.60.0"),
    ("jsonschema", "4.26.0"),
    ("jsonschema-specifications", "2025.9.1"),
    ("referencing", "0.37.0"),
    ("rpds-py", "2026.9.1"),
)
# pip matches a manylinux tag exactly: list every one the host's glibc runs (megatron-core is manylinux_2_28,
# ray and torch-memory-saver manylinux2014).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"
LIMIT_BYTES = 64 * 1024**2  # what one device call carries, the working tree included
RAY_DROPPED_FOLDER = "ray/jars/"
_MIB = 1024**2


class WheelError(RuntimeError):
    """A wheel folder that cannot be carried: a wheel missing or twice, a broken RECORD, over the limit."""


def project_of(wheel_name: str) -> str:
    """The normalized project name of a wheel file name: ``rpds_py-2026.9.1-cp312-....whl`` -> ``rpds-py``."""
    return re.sub(r"[-_.]+", "-", wheel_name.split("-", 1)[0]).lower()


def download_command(dest: Path, python: str = sys.executable, find_links: str | None = None,
                     no_index: bool = False, skip: frozenset[str] = frozenset()) -> list[str]:
    """The one ``pip download`` of every pinned wheel for the host (Python 3.12, manylinux x86-64), but the
    projects in ``skip``."""
    cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    if find_links:
        cmd += ["--find-links", find_links]
    if no_index:
        cmd.append("--no-index")
    return cmd + [f"{name}=={version}" for name, version in WHEELS if name not in skip]


# --------------------------------------------------------------------------------------------- RECORD
def _record_hash(data: bytes) -> str:
    """The wheel RECORD form of a sha256: ``sha256=`` + urlsafe base64 without padding (PEP 376 / 427)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


def _record_name(names: list[str]) -> str:
    records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise WheelError(f"expected one top-level *.dist-info/RECORD, found {records or 'none'}")
    return records[0]


def record_problems(wheel: Path) -> list[str]:
    """What is wrong with ``wheel``'s RECORD: a file without a line, a line without a file, a hash or size that
    differs from the file's bytes. Empty when every file is listed with its sha256 and size (RECORD itself with
    neither)."""
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        record = _record_name(names)
        rows = {row[0]: row for row in csv.reader(io.StringIO(zf.read(record).decode("utf-8"))) if row}
        for name in names:
            row = rows.get(name)
            if row is None:
                problems.append(f"{name}: in the wheel, not in RECORD")
                continue
            if name == record:
                continue
            data = zf.read(name)
            if len(row) < 3 or row[1] != _record_hash(data) or row[2] != str(len(data)):
                problems.append(f"{name}: RECORD says {','.join(row[1:])}, the file is "
                                f"{_record_hash(data)},{len(data)}")
        for name in sorted(set(rows) - set(names)):
            problems.append(f"{name}: in RECORD, not in the wheel")
    return problems


def strip_folder(wheel: Path, folder: str, out: Path) -> tuple[int, int]:
    """Write ``wheel`` without the files under ``folder`` (``"ray/jars/"``) to ``out`` (same entries, order and
    compression otherwise), with a RECORD that lists exactly the files kept. Returns (files dropped, bytes
    dropped, uncompressed). ``out`` may not be ``wheel``."""
    if not folder.endswith("/"):
        raise ValueError(f"folder {folder!r}: give a folder path ending in '/'")
    if Path(out).resolve() == Path(wheel).resolve():
        raise ValueError("strip_folder writes a new file: out must differ from wheel")
    dropped = dropped_bytes = 0
    with zipfile.ZipFile(wheel) as src:
        record = _record_name(src.namelist())
        rows = [row for row in csv.reader(io.StringIO(src.read(record).decode("utf-8"))) if row]
        with zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                if info.filename.startswith(folder):
                    dropped += 0 if info.is_dir() else 1
                    dropped_bytes += info.file_size
                    continue
                if info.filename == record:
                    continue  # written last, rewritten
                dst.writestr(info, src.read(info.filename), compress_type=info.compress_type)
            kept = [row for row in rows if not row[0].startswith(folder)]
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(kept)
            info = src.getinfo(record)
            dst.writestr(info, text.getvalue().encode("utf-8"), compress_type=info.compress_type)
    if dropped == 0:
        raise WheelError(f"{wheel.name} has no files under {folder}: nothing to strip (already stripped?)")
    return dropped, dropped_bytes


def _has_folder(wheel: Path, folder: str) -> bool:
    with zipfile.ZipFile(wheel) as zf:
        return any(n.startswith(folder) for n in zf.namelist())


# --------------------------------------------------------------------------------------------- the folder
@dataclass(frozen=True)
class Summary:
    wheels: dict[str, Path]  # project -> wheel
    total_bytes: int


def check_folder(dest: Path) -> Summary:
    """Every pinned wheel once, in its pinned version, ray without its jars; :class:`WheelError` otherwise."""
    found: dict[str, list[Path]] = {}
    for path in sorted(dest.glob("*.whl")):
        found.setdefault(project_of(path.name), []).append(path)
    problems = []
    for name, version in WHEELS:
        paths = found.get(name, [])
        if not paths:
            problems.append(f"{name}=={version}: no wheel")
        elif len(paths) > 1:
            problems.append(f"{name}: {len(paths)} wheels ({', '.join(p.name for p in paths)}); keep one: two "
                            "versions of one package stop the whole install")
        elif paths[0].name.split("-")[1] != version:
            problems.append(f"{name}: {paths[0].name} is not version {version}")
    extra = sorted(set(found) - {name for name, _ in WHEELS})
    if extra:
        problems.append(f"wheels not in the set: {', '.join(p.name for e in extra for p in found[e])} (remove them)")
    ray = found.get("ray", [])
    if len(ray) == 1 and _has_folder(ray[0], RAY_DROPPED_FOLDER):
        problems.append(f"{ray[0].name} still holds {RAY_DROPPED_FOLDER}")
    if problems:
        raise WheelError("; ".join(problems))
    wheels = {name: found[name][0] for name, _ in WHEELS}
    return Summary(wheels, sum(p.stat().st_size for p in wheels.values()))


def strip_ray(dest: Path) -> str:
    """Rebuild the ray wheel in ``dest`` without ``ray/jars/`` (in place, same file name); a no-op when done."""
    wheels = [p for p in dest.glob("*.whl") if project_of(p.name) == "ray"]
    if len(wheels) != 1:
        raise WheelError(f"expected one ray wheel in {dest}, found {len(wheels)}")
    wheel = wheels[0]
    if not _has_folder(wheel, RAY_DROPPED_FOLDER):
        return f"{wheel.name}: already without {RAY_DROPPED_FOLDER}"
    before = wheel.stat().st_size
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        out = Path(tmp) / wheel.name
        dropped, dropped_bytes = strip_folder(wheel, RAY_DROPPED_FOLDER, out)
        problems = record_problems(out)
        if problems:
            raise WheelError(f"the rebuilt {wheel.name} has a broken RECORD: {'; '.join(problems[:5])}")
        os.replace(out, wheel)
    return (f"{wheel.name}: dropped {dropped} file(s) under {RAY_DROPPED_FOLDER} ({dropped_bytes / _MIB:.1f} MiB "
            f"unpacked); {before / _MIB:.1f} -> {wheel.stat().st_size / _MIB:.1f} MiB, RECORD consistent")


def tree_bytes(repo: Path) -> int | None:
    """Bytes of the files git would carry (tracked and untracked-not-ignored), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for name in out.split(b"\0"):
        path = repo / os.fsdecode(name)
        if name and path.is_file():
            total += path.stat().st_size
    return total


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=repo / ".whl", help="wheel folder (default: .whl/ of the repo)")
    parser.add_argument("--find-links", help="also look for wheels here (a folder or index URL), passed to pip")
    parser.add_argument("--no-index", action="store_true", help="only --find-links, no package index (passed to pip)")
    parser.add_argument("--python", default=sys.executable, help="the python whose pip downloads (default: this one)")
    args = parser.parse_args(argv)
    dest: Path = args.dest
    dest.mkdir(parents=True, exist_ok=True)
    stale = [p for p in dest.glob("*.whl") if project_of(p.name) not in {n for n, _ in WHEELS}]
    if stale:
        print(f"prepare_gpu_wheels: {dest} holds wheels outside the set: "
              f"{', '.join(p.name for p in stale)}; remove them first", file=sys.stderr)
        return 1
    # A stripped ray wheel keeps ray's file name: ask pip only for what is not there yet in its pinned version.
    ray_version = dict(WHEELS)["ray"]
    done = frozenset("ray" for p in dest.glob(f"ray-{ray_version}-*.whl") if not _has_folder(p, RAY_DROPPED_FOLDER))
    cmd = download_command(dest, args.python, args.find_links, args.no_index, skip=done)
    print("prepare_gpu_wheels: $ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"prepare_gpu_wheels: pip download exited with {rc}", file=sys.stderr)
        return 1
    try:
        print("prepare_gpu_wheels: " + strip_ray(dest))
        summary = check_folder(dest)
    except WheelError as e:
        print(f"prepare_gpu_wheels: {e}", file=sys.stderr)
        return 1
    for name, path in summary.wheels.items():
        print(f"  {path.stat().st_size / _MIB:7.2f} MiB  {path.name}")
    tree = tree_bytes(repo)
    carried = summary.total_bytes + (tree or 0)
    print(f"prepare_gpu_wheels: {len(summary.wheels)} wheels, {summary.total_bytes / _MIB:.2f} MiB"
          + (f"; with the working tree ({tree / _MIB:.2f} MiB) {carried / _MIB:.2f} MiB" if tree is not None else "")
          + f" of the {LIMIT_BYTES / _MIB:.0f} MiB a device call carries")
    if summary.total_bytes > LIMIT_BYTES:
        print(f"prepare_gpu_wheels: the wheels alone are over {LIMIT_BYTES / _MIB:.0f} MiB", file=sys.stderr)
        return 1
    if carried > LIMIT_BYTES:
        print(f"prepare_gpu_wheels: wheels + working tree are over {LIMIT_BYTES / _MIB:.0f} MiB: the tree "
              "will not travel with them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
