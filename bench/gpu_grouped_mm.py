"""Grouped GEMM time at the routed-expert shapes as the operands' K/N and layout change.

    python bench/gpu_grouped_mm.py --out $OUT/gpu_grouped_mm.json

Why: folding a rank-r adapter into the base grouped GEMM (``k3/kernels/expert_lora/folded.py``) makes K (gate/up)
or N (down) grow by r and makes gate's and up's A operands column slices of one wider buffer. Whether the native
kernel (``F.grouped_mm`` / ``torch._grouped_mm``) keeps its speed for such K/N and strides decides whether the
fold pays. Each case is one grouped GEMM ``[rows, K] x [E, K, N]`` over ``E`` experts with the bench's seeded
uneven counts, timed side by side with the base shape in one process; ``vs base`` is ``time / base time``
and ``vs flops`` is that ratio divided by the ratio of useful FLOPs (1.0 = the same efficiency as the base).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_expert_lora import DTYPES, expert_counts, shape_arguments, time_side_by_side  # noqa: E402
from measure import report  # noqa: E402

from k3.kernels.grouped_mm import grouped_mm  # noqa: E402


def cases(Lt: int, Fi: int, r: int) -> list[dict]:
    """(name, K, N, a_width): A is ``[rows, K]``, a column slice of ``[rows, a_width]`` when a_width > K."""
    up = lambda n, m: -(-n // m) * m  # noqa: E731 - round up to a multiple
    return [
        {"name": "gate/up base", "K": Lt, "N": Fi, "a_width": Lt},
        {"name": "gate/up K+r, contiguous A", "K": Lt + r, "N": Fi, "a_width": Lt + r},
        {"name": "gate/up K+r, A a slice of [rows, K+2r]", "K": Lt + r, "N": Fi, "a_width": Lt + 2 * r},
        {"name": "gate/up K+2r, contiguous A", "K": Lt + 2 * r, "N": Fi, "a_width": Lt + 2 * r},
        {"name": "gate/up K+r padded to 128", "K": up(Lt + r, 128), "N": Fi, "a_width": up(Lt + r, 128)},
        {"name": "gate/up K+r padded to 256", "K": up(Lt + r, 256), "N": Fi, "a_width": up(Lt + r, 256)},
        {"name": "down base", "K": Fi, "N": Lt, "a_width": Fi},
        {"name": "down N+r", "K": Fi, "N": Lt + r, "a_width": Fi},
        {"name": "down N+r padded to 128", "K": Fi, "N": up(Lt + r, 128), "a_width": Fi},
        {"name": "down N+r padded to 256", "K": Fi, "N": up(Lt + r, 256), "a_width": Fi},
        {"name": "adapter B: [rows, r] x [E, r, F]", "K": r, "N": Fi, "a_width": r},
        {"name": "adapter A: [rows, F] x [E, F, r]", "K": Fi, "N": r, "a_width": Fi},
    ]


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    E, Lt, Fi, r = args.experts, args.latent, args.width, args.rank
    counts = expert_counts(E, args.tokens_per_expert).to(device)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(0)
    fns, meta = {}, {}
    for c in cases(Lt, Fi, r):
        a = torch.randn(rows, c["a_width"], generator=gen, device=device).to(dtype)[:, c["a_width"] - c["K"]:]
        w = torch.randn(E, c["N"], c["K"], generator=gen, device=device).to(dtype)  # [E, out, in]
        fns[c["name"]] = (lambda a=a, w=w: grouped_mm(a, w, counts))
        meta[c["name"]] = c
    t = time_side_by_side(fns, args.repeats, args.warmup, device)
    results = []
    for name, ms in t.items():
        c = meta[name]
        base = "gate/up base" if name.startswith("gate/up") else "down base" if name.startswith("down") else None
        flops = 2 * rows * c["K"] * c["N"]
        row = {**c, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        if base is not None:
            b = meta[base]
            row["vs_base"] = ms / t[base]
            row["vs_flops"] = row["vs_base"] / ((c["K"] * c["N"]) / (b["K"] * b["N"]))
        results.append(row)
    return {"bench": "gpu_grouped_mm", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "rows": rows, "experts": E, "rank": r,
            "repeats": args.repeats, "results": results,
            "command": "python bench/gpu_grouped_mm.py " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    lines = [f"# grouped GEMM, {result['experts']} experts, {result['rows']} rows, {result['dtype']} on "
             f"{result['device']} (torch {result['torch']})", "",
             "| case | K | N | A row width | ms | TFLOP/s | vs base | vs flops |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        vb = f"{r['vs_base']:.3f}" if "vs_base" in r else ""
        vf = f"{r['vs_flops']:.3f}" if "vs_flops" in r else ""
        lines.append(f"| {r['name']} | {r['K']} | {r['N']} | {r['a_width']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{vb} | {vf} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = shape_arguments(ap, repeats=20).parse_args(argv)
    result = run(args)
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
