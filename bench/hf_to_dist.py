"""``k3 convert hf-to-dist`` (BF16 HF -> megatron torch_dist) by ``--save-writers``, against ``cp`` of the source.

    .venv/bin/python bench/hf_to_dist.py --work-dir /tmp/k3_dist_bench                   # 6.6 GB, 2-core box
    python3 bench/hf_to_dist.py --num-experts 8 --num-layers 4 --writers 2,8 --work-dir /tmp/db --out $OUT/d.json

The source is a synthetic BF16 checkpoint (``k3 make-checkpoint``, default: the 4layer width cut to one layer with
4 routed experts, 6.6 GB, most of it the embedding and the head), written once. Then, on the same machine state:

- ``cp -r SRC DST && sync``: the anchor, the same bytes copied by the kernel and flushed;
- ``k3 convert hf-to-dist`` (one process, TP1) once per ``--writers`` value: it reads the source, builds the model
  and writes the torch_dist checkpoint with that many writer processes (one ``.distcp`` file each).

Before each run the source is read once, so every run starts with it in the page cache. Each run is timed by the
wall clock in a subprocess (interpreter start and imports included); "convert s" is the command's own figure (from
its start to the checkpoint written); GB/s = bytes written / wall seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# bench/folder_io.py and bench/measure.py, beside this script (run as `python bench/hf_to_dist.py`)
from folder_io import dir_bytes, read_through  # noqa: E402
from measure import report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_CONVERT_SECONDS = re.compile(r"wrote \S+ \(TP=1, EP=1, PP=1\) in ([0-9.]+) s")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def timed(cmd: list[str], shell: bool = False) -> tuple[float, str]:
    """Wall seconds of ``cmd`` and its output; raises SystemExit with the output when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(" ".join(cmd) if shell else cmd, shell=shell, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return wall, proc.stdout + proc.stderr


def convert_seconds(output: str) -> float | None:
    """The time ``k3 convert hf-to-dist`` reports for itself, or None when its line is not in ``output``."""
    m = _CONVERT_SECONDS.search(output)
    return float(m.group(1)) if m else None


def row(what: str, writers: int | None, wall: float, size: int, convert_s: float | None = None) -> dict:
    return {"run": what, "writers": writers, "seconds": round(wall, 2), "convert_s": convert_s, "bytes": size,
            "gb_per_s": size / wall / 1e9}  # unrounded: a tiny run is far below 1e-4 GB/s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="4layer")
    ap.add_argument("--num-experts", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--writers", default="1,2,4", help="comma-separated --save-writers values, run in this order")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/k3_dist_bench"),
                    help="scratch folder (needs ~3x the source size)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    writers = [int(w) for w in args.writers.split(",")]
    if any(w < 1 for w in writers):
        ap.error(f"--writers {args.writers}: every value must be at least 1")

    args.work_dir.mkdir(parents=True, exist_ok=True)
    src, dst = args.work_dir / "hf", args.work_dir / "out"
    shutil.rmtree(src, ignore_errors=True)
    made, _ = timed([sys.executable, "-m", "k3", "make-checkpoint", "--out", str(src), "--variant", args.variant,
                     "--num-experts", str(args.num_experts), "--num-layers", str(args.num_layers), "--format",
                     "bf16", "--no-progress"])
    print(f"source: {dir_bytes(src) / 1e9:.2f} GB in {made:.1f} s", flush=True)

    rows = []
    try:
        for w in [None, *writers]:
            shutil.rmtree(dst, ignore_errors=True)
            read_through(src)
            if w is None:
                wall, _ = timed(["cp", "-r", str(src), str(dst), "&&", "sync"], shell=True)
                rows.append(row("cp -r SRC && sync", None, wall, dir_bytes(dst)))
            else:
                wall, out = timed([sys.executable, "-m", "k3", "convert", "hf-to-dist", "--hf-checkpoint",
                                   str(src), "--save", str(dst), "--no-progress", "--save-writers", str(w)])
                rows.append(row(f"hf-to-dist --save-writers {w}", w, wall, dir_bytes(dst), convert_seconds(out)))
            r = rows[-1]
            print(f"{r['run']}: {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s = {r['gb_per_s']:.3f} GB/s",
                  flush=True)
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)

    cpus = len(os.sched_getaffinity(0))
    machine = f"{platform.processor() or platform.machine()}, {cpus} CPUs"
    cp = rows[0]
    lines = [f"hf-to-dist: {args.variant}, {args.num_layers} layer(s), {args.num_experts} experts, BF16; {machine}",
             "", "| run | GB written | wall s | convert s | GB/s | vs cp |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        conv = "" if r["convert_s"] is None else f"{r['convert_s']:.1f}"
        lines.append(f"| {r['run']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.1f} | {conv} | {r['gb_per_s']:.3f} | "
                     f"{r['gb_per_s'] / cp['gb_per_s']:.2f}x |")
    result = {"variant": args.variant, "num_experts": args.num_experts, "num_layers": args.num_layers,
              "machine": machine, "cpus": cpus, "runs": rows}
    return report(result, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
