"""MXFP4 -> BF16 decode on the GPU vs a device-to-device copy, side by side in one process.

    python bench/gpu_mxfp4.py --out $OUT/gpu_mxfp4.json     # one EP8 rank's experts: w1/w3- and w2-shaped stacks

Decoders: the Triton kernel (``k3.kernels.mxfp4.triton``, its default tile and a few others), its plain-torch
fallback, and the CPU codec's table gather run on the GPU (``k3.kernels.mxfp4.codec.decode_mxfp4``, the naive
baseline). Bytes moved per decode = packed + scales read + BF16 written; the copy anchor moves the BF16 output's
size read + written. Goal: decode >= 50% of the copy's bytes per second (issue #7). Every output is checked bit
for bit: against the Triton default on the whole tensor, and against the CPU codec on the first expert.

A second table times the converter's ``--device cuda`` path for one 64 MiB chunk (``TorchPairDecoder``: host ->
GPU, decode, GPU -> pinned host) against the CPU decoder (``PairDecoder``, one thread) on the same chunk.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py
from measure import elapsed_ms, report  # noqa: E402

from k3.kernels.mxfp4.codec import E8M0_MAX_FINITE_BF16, PairDecoder
from k3.kernels.mxfp4.codec import decode_mxfp4 as codec_decode
from k3.kernels.mxfp4.triton import TorchPairDecoder, decode_mxfp4, triton_available

GOAL = 0.5
# (block_rows, block_bytes, num_warps); rows of a multiple of 16 bytes run the flat kernel on tiles of
# block_rows * block_bytes consecutive bytes
TRITON_TILES = [(16, 256, 4), (8, 512, 8), (32, 256, 8), (64, 256, 8), (4, 256, 4)]


def median_ms(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeats))


def stack(experts: int, out_features: int, in_features: int, device: torch.device, seed: int):
    """Random packed bytes and finite scales of an expert stack ``[experts, out, in]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (experts, out_features, in_features // 2), generator=gen, device=device,
                           dtype=torch.uint8)
    scale = torch.randint(100, E8M0_MAX_FINITE_BF16 + 1, (experts, out_features, in_features // 32), generator=gen,
                          device=device, dtype=torch.uint8)
    return packed, scale


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    decoders: list[tuple[str, Callable]] = []
    if triton_available() and device.type == "cuda":
        for br, bb, nw in TRITON_TILES:
            decoders.append((f"triton {br}x{bb} bytes, {nw} warps",
                             lambda p, s, br=br, bb=bb, nw=nw: decode_mxfp4(p, s, impl="triton", block_rows=br,
                                                                            block_bytes=bb, num_warps=nw)))
    decoders.append(("torch fallback (same arithmetic)", lambda p, s: decode_mxfp4(p, s, impl="torch")))
    decoders.append(("codec table gather on the device (naive)", codec_decode))
    tables = [
        decode_table(f"w1/w3 [E, {args.width}, {args.latent}]", args.width, args.latent, args, device, decoders, 0),
        decode_table(f"w2 [E, {args.latent}, {args.width}]", args.latent, args.width, args, device, decoders, 1),
    ]
    return {
        "bench": "gpu_mxfp4",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": _triton_version(), "goal": GOAL, "tables": tables,
        "converter_chunk": converter_chunk(args, device),
        "command": "python bench/gpu_mxfp4.py " + " ".join(sys.argv[1:]),
    }


def decode_table(label: str, out_f: int, in_f: int, args: argparse.Namespace, device: torch.device,
                 decoders: list[tuple[str, Callable]], seed: int) -> dict:
    """Every decoder and the copy anchor on one expert stack ``[experts, out_f, in_f]``."""
    packed, scale = stack(args.experts, out_f, in_f, device, seed=seed)
    out_bytes = packed.numel() * 4
    moved = packed.numel() + scale.numel() + out_bytes
    src = torch.empty(out_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t_copy = median_ms(lambda: dst.copy_(src), args.repeats, args.warmup, device)
    copy_gbs = 2 * out_bytes / (t_copy * 1e-3) / 1e9
    src = dst = None  # free before the decoders allocate their outputs
    first_expert = codec_decode(packed[0].cpu(), scale[0].cpu()).view(torch.int16)
    reference = None
    rows = [{"decoder": "D2D copy of the BF16 output (anchor)", "ms": t_copy, "gb_per_s": copy_gbs,
             "ratio_to_copy": 1.0, "exact": None}]
    for name, fn in decoders:
        t = median_ms(lambda fn=fn: fn(packed, scale), args.repeats, args.warmup, device)
        out = fn(packed, scale).view(torch.int16)
        if reference is None:
            reference = out
        exact = bool(torch.equal(out, reference)) and bool(torch.equal(out[0].cpu(), first_expert))
        out = None
        gbs = moved / (t * 1e-3) / 1e9
        rows.append({"decoder": name, "ms": t, "gb_per_s": gbs, "ratio_to_copy": gbs / copy_gbs,
                     "exact": exact, "meets_goal": gbs / copy_gbs >= GOAL})
        print(f"  {label} {name}: {t:.3f} ms", file=sys.stderr, flush=True)
    return {"shape": label, "experts": args.experts, "packed_mib": moved / 2**20, "rows": rows}


def converter_chunk(args: argparse.Namespace, device: torch.device) -> dict:
    """The converter's chunk on each decoder: host bytes in, host BF16 words out (what gets written)."""
    n_bytes = args.latent // 2
    rows = max(1, args.converter_chunk_mib * 2**20 // (4 * n_bytes))
    gen = np.random.default_rng(0)
    packed = gen.integers(0, 256, (rows, n_bytes), dtype=np.uint8)
    scale = gen.integers(100, E8M0_MAX_FINITE_BF16 + 1, (rows, n_bytes // 16), dtype=np.uint8)
    cpu = PairDecoder()
    ours = TorchPairDecoder(device) if device.type == "cuda" else TorchPairDecoder("cpu", impl="torch")
    out = {}
    for name, dec in (("cpu PairDecoder (1 thread)", cpu), (f"TorchPairDecoder on {device.type}", ours)):
        times = []
        for i in range(args.warmup + max(3, args.repeats // 3)):
            t0 = time.perf_counter()
            dec.decode(packed, scale)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        out[name] = {"ms": 1e3 * statistics.median(times),
                     "output_gb_per_s": rows * n_bytes * 4 / statistics.median(times) / 1e9}
    exact = bool(np.array_equal(cpu.decode(packed, scale), ours.decode(packed, scale)))
    return {"rows": rows, "output_mib": rows * n_bytes * 4 / 2**20, "decoders": out, "exact": exact}


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken
        return "absent"


def markdown(result: dict) -> str:
    lines = [(f"# MXFP4 -> BF16 decode on {result['device']} (torch {result['torch']}, triton {result['triton']}); "
             "bytes moved = packed + scales + BF16 output")]
    for t in result["tables"]:
        lines += ["", f"## {t['shape']}, {t['experts']} experts ({t['packed_mib']:.0f} MiB moved per decode)", "",
                  "| decoder | ms | GB/s moved | vs D2D copy | goal >= 50% | bit-exact |", "|---|---:|---:|---:|---|---|"]
        for r in t["rows"]:
            goal = "" if r["exact"] is None else ("yes" if r["meets_goal"] else "NO")
            exact = "" if r["exact"] is None else ("yes" if r["exact"] else "NO")
            lines.append(f"| {r['decoder']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | {100 * r['ratio_to_copy']:.0f}% | "
                         f"{goal} | {exact} |")
    c = result["converter_chunk"]
    lines += ["", (f"## converter chunk: {c['rows']} rows, {c['output_mib']:.0f} MiB of BF16, host in / host out "
              f"(bit-exact: {'yes' if c['exact'] else 'NO'})"), "", "| decoder | ms | output GB/s |", "|---|---:|---:|"]
    for name, d in c["decoders"].items():
        lines.append(f"| {name} | {d['ms']:.1f} | {d['output_gb_per_s']:.2f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=112, help="experts per stack (112 = 896 / EP8)")
    ap.add_argument("--width", type=int, default=3072, help="expert width F")
    ap.add_argument("--latent", type=int, default=3584, help="latent width Lt")
    ap.add_argument("--converter-chunk-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = run(args)
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
