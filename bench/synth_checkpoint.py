"""Synthetic checkpoint writer throughput: ``k3 make-checkpoint`` with 1 worker against N workers (and on CUDA when
there is one), in GB/s of checkpoint written, and whether every run wrote the same bytes.

    .venv/bin/python bench/synth_checkpoint.py --work-dir /tmp/k3_synth_bench --out bench_synth.json
    python3 bench/synth_checkpoint.py --num-experts 32 --runs cpu:16,cuda:1,cuda:4,cpu:1 \\
        --work-dir /tmp/k3_synth_bench --out $OUT/synth.json                              # the H200 host

Every run is the real command in a subprocess (interpreter start and the final fsyncs included), timed by the wall
clock; the output is deleted after each run, once the sha256 of every file is taken (``--no-check-bytes`` skips
that). GB/s = bytes of the checkpoint folder / wall seconds; the command's own line splits its time into the
phases the writer reports (start-up = interpreter, imports and planning; write = workers started, values generated
and written into the page cache, with its GB/s; fsync = the flush to disk), so a slow run says which part was slow;
CPU-s = user + sys of the command and its workers (on a shared machine, GB per CPU-s says more than the wall
clock). A ``disk:N`` run is the anchor: N threads write
as many bytes as the run before it (else 4 GB) of incompressible data with ``pwrite`` into one file, then fsync it,
in this process: what the disk under ``--work-dir`` takes, so a writer's GB/s reads against it. The default size,
the 4layer width with 4 routed experts per layer (11.2 GB in BF16), fits a 2-core 24 GiB dev machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import report  # noqa: E402  (bench/measure.py: run as `python bench/synth_checkpoint.py`)

ROOT = Path(__file__).resolve().parents[1]


def file_hashes(d: Path) -> dict[str, str]:
    """sha256 of every file in ``d``, hashed in parallel threads (hashlib releases the GIL on large reads)."""

    def one(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
        return h.hexdigest()

    files = sorted(p for p in d.iterdir() if p.is_file())
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as ex:
        return dict(zip((p.name for p in files), ex.map(one, files)))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def children_cpu() -> float:
    """CPU seconds (user + sys) of the finished child processes and theirs (the writer's workers included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(args: argparse.Namespace, workers: int, device: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "k3", "make-checkpoint", "--out", str(out), "--variant", args.variant,
           "--format", args.format, "--seed", str(args.seed), "--workers", str(workers), "--device", device,
           "--no-progress", "--overwrite"]
    if args.num_experts is not None:
        cmd += ["--num-experts", str(args.num_experts)]
    if args.num_layers is not None:
        cmd += ["--num-layers", str(args.num_layers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu = children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    row = {"workers": workers, "device": device, "seconds": round(wall, 2), "bytes": size,
           "gb_per_s": round(size / wall / 1e9, 4), "cpu_s": round(cpu, 1),
           "gb_per_cpu_s": round(size / cpu / 1e9, 4), **command_phases(proc.stdout, wall)}
    if args.check_bytes:
        row["sha256"] = file_hashes(out)
    shutil.rmtree(out)
    return row


_PHASES = re.compile(r"files ([0-9.]+) s, generate \+ write ([0-9.]+) s \(([0-9.]+|inf) GB/s\), fsync ([0-9.]+) s")


def command_phases(stdout: str, wall: float) -> dict:
    """The phases of ``k3 make-checkpoint``'s closing line (``k3.checkpoint.synth.phases_text``), seconds, plus
    ``startup_s``: the wall time outside them (interpreter, imports, planning, the rename). Empty when the line
    is not there (an older k3)."""
    m = _PHASES.search(stdout)
    if m is None:
        return {}
    files_s, write_s, rate, fsync_s = (float(g) for g in m.groups())
    return {"startup_s": round(wall - files_s - write_s - fsync_s, 2), "write_s": write_s,
            "write_gb_per_s": rate, "fsync_s": fsync_s}


def phases_text(row: dict) -> str:
    if "write_s" not in row:
        return ""
    return (f" (start-up {row['startup_s']:.1f} s, write {row['write_s']:.1f} s = {row['write_gb_per_s']:.2f} GB/s, "
            f"fsync {row['fsync_s']:.1f} s)")


DISK_BLOCK = 64 << 20


def disk_once(total: int, threads: int, out: Path) -> dict:
    """Write ``total`` bytes (rounded up to 64 MiB blocks) with ``threads`` pwrite threads into ``out``, fsync it,
    delete it: the disk's write rate in the same run as the writer's, GB/s of wall time."""
    block = memoryview(os.urandom(DISK_BLOCK))
    blocks = -(-total // DISK_BLOCK)
    t0 = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        def write(i: int) -> None:
            done = 0
            while done < DISK_BLOCK:  # pwrite may write less than asked
                done += os.pwrite(fd, block[done:], i * DISK_BLOCK + done)

        with ThreadPoolExecutor(max_workers=threads) as ex:
            list(ex.map(write, range(blocks)))
        os.fsync(fd)
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    out.unlink()
    size = blocks * DISK_BLOCK
    return {"workers": threads, "device": "disk", "seconds": round(wall, 2), "bytes": size,
            "gb_per_s": round(size / wall / 1e9, 4), "cpu_s": None, "gb_per_cpu_s": None}


def cpu_text(row: dict) -> str:
    return "" if row["cpu_s"] is None else f", {row['cpu_s']:.0f} CPU-s"


def main(argv: list[str] | None = None) -> dict:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="4layer")
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--format", default="bf16", choices=("bf16", "mxfp4"))
    p.add_argument("--seed", type=int, default=0)
    default_runs = f"cpu:1,cpu:{cpus}" + (f",cuda:1,cuda:{min(cpus, 4)}" if torch.cuda.is_available() else "")
    p.add_argument("--runs", default=default_runs,
                   help=f"comma-separated DEVICE:WORKERS runs, in order, DEVICE one of cpu, cuda and disk (the anchor: "
                   f"pwrite + fsync of as many bytes as the run before it) (default {default_runs})")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/k3_synth_bench"))
    p.add_argument("--check-bytes", action=argparse.BooleanOptionalAction, default=True,
                   help="sha256 every file of every run and compare (default on)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in args.runs.split(","):
        device, w = run.split(":")
        if device == "disk":
            row = disk_once(rows[-1]["bytes"] if rows else 4_000_000_000, int(w), args.work_dir / "disk_probe")
        else:
            row = run_once(args, int(w), device, args.work_dir / "ckpt")
        rows.append(row)
        first = next((r["sha256"] for r in rows if "sha256" in r), None)
        same = "" if "sha256" not in row else f", same bytes as the first run: {row['sha256'] == first}"
        print(f"{device} workers={w}: {row['bytes'] / 1e9:.2f} GB in {row['seconds']:.1f} s "
              f"= {row['gb_per_s']:.3f} GB/s{phases_text(row)}{cpu_text(row)}{same}", flush=True)
    hashed = [r["sha256"] for r in rows if "sha256" in r]
    same = all(h == hashed[0] for h in hashed) if hashed else None
    base = rows[0]["gb_per_s"]
    machine = f"{cpu_model()}, {cpus} CPUs"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    lines = [f"Synthetic checkpoint: {args.variant}, {args.num_experts} experts, {args.format}; {machine}; "
             f"same bytes in every run: {same}", "",
             "| device | workers | GB | seconds | GB/s | vs first row | start-up s | write s (GB/s) | fsync s | CPU-s "
             "| GB per CPU-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        phases = ("- | - | - |" if "write_s" not in r else
                  f"{r['startup_s']:.1f} | {r['write_s']:.1f} ({r['write_gb_per_s']:.2f}) | {r['fsync_s']:.1f} |")
        lines.append(f"| {r['device']} | {r['workers']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.1f} | "
                     f"{r['gb_per_s']:.3f} | {r['gb_per_s'] / base if base else float('nan'):.2f}x | {phases} "
                     + ("- | - |" if r["cpu_s"] is None else f"{r['cpu_s']:.0f} | {r['gb_per_cpu_s']:.3f} |"))
    result = {"variant": args.variant, "num_experts": args.num_experts, "num_layers": args.num_layers,
              "format": args.format, "machine": machine, "cpus": cpus, "same_bytes": same,
              "runs": [{k: v for k, v in r.items() if k != "sha256"} for r in rows],
              "sha256": hashed[0] if hashed else None}
    return report(result, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
