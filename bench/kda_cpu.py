"""Chunked vs per-token KDA core forward on this CPU; prints a Markdown table.

    .venv/bin/python bench/kda_cpu.py                      # T=1024, 4 heads x 64, batch 1, fp32, 1 thread
    .venv/bin/python bench/kda_cpu.py --seq-len 4096 --threads 2

Both cores get identical inputs (K3's lower-bounded gate, L2-normalised q/k) and are timed side by side in
one process; the table reports the median of ``--repeats`` runs after one warm-up and the largest output
difference from the naive core, for several chunk lengths.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from k3.kernels.kda.chunk import DEFAULT_CHUNK_SIZE, chunk_kda
from k3.kernels.kda.naive import naive_recurrent_kda


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk-sizes", default=f"8,{DEFAULT_CHUNK_SIZE},32,64",
                    help=f"comma-separated chunk lengths to time (the default core uses {DEFAULT_CHUNK_SIZE})")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="gate lower bound (K3: -5)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = args.batch, args.seq_len, args.heads, args.head_dim
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = args.lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)

    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    rows = []
    with torch.no_grad():
        o_naive, _ = naive_recurrent_kda(q, k, v, g, beta)
        naive = median_ms(lambda: naive_recurrent_kda(q, k, v, g, beta), args.repeats)
        for c in chunk_sizes:
            o_chunk, _ = chunk_kda(q, k, v, g, beta, chunk_size=c)
            ms = median_ms(lambda: chunk_kda(q, k, v, g, beta, chunk_size=c), args.repeats)
            rows.append((c, ms, (o_naive - o_chunk).abs().max().item()))

    print(f"KDA core forward, fp32, batch {B}, T {T}, {H} heads x {K}, gate lower bound {args.lower_bound}, "
          f"{args.threads} thread(s), torch {torch.__version__}, {cpu_name()}, median of {args.repeats}")
    print()
    print("| core | median ms | speed-up vs naive | max abs diff vs naive |")
    print("|---|---:|---:|---:|")
    print(f"| naive per-token recurrence | {naive:.1f} | 1.00x | 0 |")
    for c, ms, diff in rows:
        default = " (default)" if c == DEFAULT_CHUNK_SIZE else ""
        print(f"| chunked WY/UT, chunk {c}{default} | {ms:.1f} | {naive / ms:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
