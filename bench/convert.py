"""MXFP4 -> BF16 converter throughput against ``cp`` of the same bytes, with peak RSS; prints a Markdown table.

    .venv/bin/python bench/convert.py --work-dir /work/tmp_bench          # ~3.6 GB source, ~9.8 GB output
    .venv/bin/python bench/convert.py --work-dir D --experts 64 --repeats 2

The source is a synthetic checkpoint at the release's full width (hidden 7168, experts 3584 -> 3072) with one
MLA + LatentMoE layer and a 16K vocabulary, so routed experts are most of the bytes as in the release (92.7%
there, ~63% here with 128 experts; the whole release would not fit this disk). Every run is a subprocess
measured in one go, on the same machine state:

- ``cp -r SRC`` and ``cp -r OUT`` (the converter's output, i.e. the same bytes the converter writes), each
  followed by ``sync`` because the converter fsyncs every shard;
- ``k3 convert mxfp4-to-bf16`` with each ``--workers`` value.

The source is read once before each run, so every run starts with it in the page cache. Peak RSS is the largest
sum over the process tree (converter + workers), sampled every 20 ms with psutil.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from k3.checkpoint.synth import write_synthetic_checkpoint
from k3.config import variant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from folder_io import dir_bytes, read_through  # noqa: E402  (bench/folder_io.py: run as `python bench/convert.py`)


def bench_config(num_experts: int):
    # Full width, one MLA + MoE layer (first_k_dense_replace 0), small vocabulary: experts dominate the bytes.
    return variant("4layer").replace(
        num_hidden_layers=1, first_k_dense_replace=0, vocab_size=16384, num_experts=num_experts,
        linear_attn_config={"kda_layers": [], "full_attn_layers": [1]},
    )


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str] | str, shell: bool = False) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes of the process tree, CPU seconds user+sys of the tree) of one command."""
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            rss = root.memory_info().rss + sum(c.memory_info().rss for c in root.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr.read().decode()}")
    return wall, peak, children_cpu() - cpu0


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="scratch folder (needs ~3x the source size)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts of the one MoE layer")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="runs of each command; the table keeps the fastest")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = ap.parse_args()

    load0 = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"native-e{args.experts}"
    if not (src / "config.json").exists():
        write_synthetic_checkpoint(bench_config(args.experts), src, "mxfp4", seed=0, overwrite=True)
    k3 = [sys.executable, "-m", "k3", "convert", "mxfp4-to-bf16", "--model-dir", str(src),
          "--no-progress"]
    out = work / "out"
    rows = []

    def run_convert(workers: int) -> tuple[float, int]:
        best = (float("inf"), 0, 0.0)
        for _ in range(args.repeats):
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            read_through(src)
            best = min(best, timed(k3 + ["--save-dir", str(out), "--workers", str(workers)]))
        return best

    def run_cp(what: Path) -> tuple[float, int]:
        best = (float("inf"), 0, 0.0)
        for _ in range(args.repeats):
            dst = work / "cp"
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            read_through(src)
            best = min(best, timed(f"cp -r '{what}' '{dst}' && sync", shell=True))
            shutil.rmtree(dst)
        return best

    conv = {w: run_convert(w) for w in args.workers}  # leaves the last output in `out` for cp
    src_bytes, out_bytes = dir_bytes(src), dir_bytes(out)
    cp_src, cp_out = run_cp(src), run_cp(out)

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"source {src_bytes / 1e9:.2f} GB ({src.name}), output {out_bytes / 1e9:.2f} GB; {cpu_name()}, "
          f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; load average at the end "
          f"{load} (started at {load0})\n")
    print("| run | wall s | GB/s written | vs cp of the output | vs cp of the source | CPU s (user+sys) "
          "| peak RSS (tree) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows.append(("cp -r SRC && sync", cp_src, src_bytes))
    rows.append(("cp -r OUT && sync", cp_out, out_bytes))
    for w, r in conv.items():
        rows.append((f"k3 convert mxfp4-to-bf16 --workers {w}", r, out_bytes))
    for name, (wall, rss, cpu), written in rows:
        print(f"| `{name}` | {wall:.1f} | {written / wall / 1e9:.2f} | {cp_out[0] / wall:.2f}x | "
              f"{cp_src[0] / wall:.2f}x | {cpu:.1f} | {rss / 2**20:.0f} MiB |")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
