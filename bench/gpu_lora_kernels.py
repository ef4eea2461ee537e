"""The routed-expert LoRA's rank-r Triton kernels one by one at K3's EP8 shapes, against a copy's bandwidth.

    python bench/gpu_lora_kernels.py --out $OUT/gpu_lora_kernels.json      # 112 experts, F 3072, Lt 3584, r 32

Each kernel of ``k3/kernels/expert_lora/triton.py`` runs on the operands ``LoRALatentExperts(lora_impl="triton")``
gives it (the six calls of a forward+backward, below) over a sweep of tiles (``block_m`` x the wide block x warps, then
the two best with other pipeline depths); every row reports the bytes the call must move (each operand read once,
the output written once) and its GB/s as a share of a D2D copy measured in the same run. The tile that is fastest
over both calls of a kernel is its tuned tile. Beside them: the tile schedule (one Triton launch vs torch's ~20
ops), the torch GEMMs of the same path, and, with the tuned tiles applied, the module's forward+backward against
the base's and the default tiles' (side by side, as ``bench/gpu_expert_lora.py``) with its per-kernel profile.

Calls (rows sorted by expert, ``s = alpha / r``; ``xa = s·x A1ᵀ`` a column half of ``[rows, 2r]``):

    expand gate     gate += xa B1_eᵀ                 [rows, F] += [rows, r] x [E, F, r]      (forward)
    expand dh       dh   += dha A2_e                 [rows, F] += [rows, r] x [E, r, F]ᵀ     (backward)
    contract h      ha    = h A2_eᵀ                  [rows, F] x [E, r, F] -> [rows, r]     (forward)
    contract dgate  dxa   = s·dgate B1_e             [rows, F] x [E, F, r] -> [rows, r]     (backward)
    grad dB         dB1_e = dgate_eᵀ xa_e            -> [E, F, r]                           (backward)
    grad dA2        dA2_e = dha_eᵀ h_e               -> [E, r, F]                           (backward)
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py, gpu_expert_lora.py
from gpu_expert_lora import build, expert_counts, kernel_table, time_side_by_side  # noqa: E402
from measure import elapsed_ms, report  # noqa: E402

from k3.kernels import availability
from k3.kernels.expert_lora.reference import tile_schedule_reference
from k3.kernels.expert_lora.schedule import row_offsets, row_tiles, tile_schedule
from k3.kernels.expert_lora.triton import DEFAULT_BLOCKS, contract, expand_add_, weight_grad

GRIDS = {  # the swept tiles (the wide block is block_n, block_k or block_wide)
    "expand": {"block_m": [16, 32, 64, 128], "block_n": [64, 128, 256], "num_warps": [4, 8]},
    "contract": {"block_m": [16, 32, 64, 128], "block_k": [64, 128, 256], "num_warps": [4, 8]},
    "weight_grad": {"block_m": [32, 64, 128], "block_wide": [64, 128, 256], "num_warps": [4, 8]},
}
STAGES = [2, 4]  # pipeline depths tried on each kernel's two best tiles (the grid runs at the default)
DTYPE = torch.bfloat16


DEVICE = torch.device("cuda")  # --device cpu runs it under TRITON_INTERPRET=1 at toy shapes (a check of the script)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median device ms of one call of ``fn``: on CUDA the call is captured once as a CUDA graph and the replays
    are timed, so Python's launch cost (measured apart by ``launch_us``) does not count; on the CPU, wall time."""
    fn()
    fn()
    if DEVICE.type != "cuda":
        return statistics.median(elapsed_ms(fn, DEVICE) for _ in range(repeats))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = [elapsed_ms(graph.replay, DEVICE) for _ in range(repeats)]
    del graph
    return statistics.median(times)


def launch_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host microseconds per call of ``fn`` (the launch path: checks, argument binding, the driver call), with the
    device's queue not waited on."""
    fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return us


def operands(E: int, F: int, Lt: int, r: int, rows: int, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)

    return {"counts": counts, "out": rnd(rows, F), "xa2": rnd(rows, 2 * r), "dha": rnd(rows, r), "h": rnd(rows, F),
            "B1": rnd(E, F, r) * 0.1, "A2": rnd(E, r, F) * 0.1, "dxa": rnd(rows, 2 * r), "x": rnd(rows, Lt),
            "A": rnd(2 * r, Lt) * 0.1, "B2": rnd(Lt, r) * 0.1, "dx": rnd(rows, Lt), "dout": rnd(rows, Lt)}


def kernel_calls(o: dict[str, torch.Tensor], r: int) -> dict[str, tuple[str, Callable[..., object], int]]:
    """name -> (kernel, call(**tile), bytes moved): each operand read once, the output written once (bf16)."""
    rows, F = o["out"].shape
    E, c = o["B1"].shape[0], o["counts"]
    n = 2  # bytes per element
    factor = E * F * r * n
    return {
        "expand gate": ("expand", lambda **t: expand_add_(o["out"], o["xa2"][:, :r], o["B1"], c, **t),
                        2 * rows * F * n + rows * r * n + factor),
        "expand dh": ("expand", lambda **t: expand_add_(o["h"], o["dha"], o["A2"].transpose(1, 2), c, **t),
                      2 * rows * F * n + rows * r * n + factor),
        "contract h": ("contract", lambda **t: contract(o["h"], o["A2"], c, **t),
                       rows * F * n + factor + rows * r * n),
        "contract dgate": ("contract", lambda **t: contract(o["out"], o["B1"].transpose(1, 2), c, 0.5,
                                                            out=o["dxa"][:, :r], **t),
                           rows * F * n + factor + rows * r * n),
        "grad dB": ("weight_grad", lambda **t: weight_grad(o["out"], o["xa2"][:, :r], c, **t),
                    rows * F * n + rows * r * n + factor),
        "grad dA2": ("weight_grad", lambda **t: weight_grad(o["dha"], o["h"], c, **t),
                     rows * F * n + rows * r * n + factor),
    }


def pair_calls(o: dict[str, torch.Tensor], r: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (the pair in one launch, the same two calls one after the other), as the gate/up Function runs them."""
    c, xa = o["counts"], o["xa2"]
    outs, Bs = (o["out"], o["h"]), (o["B1"], o["B1"].clone())
    dxa = o["dxa"]
    return {
        "expand gate+up": (lambda: expand_add_(outs, (xa[:, :r], xa[:, r:]), Bs, c),
                           lambda: (expand_add_(outs[0], xa[:, :r], Bs[0], c),
                                    expand_add_(outs[1], xa[:, r:], Bs[1], c))),
        "contract dgate+dup": (lambda: contract(outs, tuple(B.transpose(1, 2) for B in Bs), c, 0.5,
                                                out=(dxa[:, :r], dxa[:, r:])),
                               lambda: (contract(outs[0], Bs[0].transpose(1, 2), c, 0.5, out=dxa[:, :r]),
                                        contract(outs[1], Bs[1].transpose(1, 2), c, 0.5, out=dxa[:, r:]))),
        "grad dB1+dB3": (lambda: weight_grad(outs, (xa[:, :r], xa[:, r:]), c),
                         lambda: (weight_grad(outs[0], xa[:, :r], c), weight_grad(outs[1], xa[:, r:], c))),
    }


def torch_calls(o: dict[str, torch.Tensor], r: int, s: float = 2.0) -> dict[str, tuple[Callable[[], object], int]]:
    """The path's torch GEMMs (cuBLAS), with the bytes they must move."""
    rows, Lt = o["x"].shape
    n = 2
    wide, narrow = rows * Lt * n, rows * 2 * r * n
    ha = o["dha"]
    return {
        "xa = s·x Aᵀ (fwd)": (lambda: (o["x"] @ o["A"].T).mul_(s), wide + narrow),
        "out += s·ha B2ᵀ (fwd, addmm_)": (lambda: o["dout"].addmm_(ha, o["B2"].T, alpha=s), 2 * wide + narrow // 2),
        "dx += dxa A (bwd, addmm_)": (lambda: o["dx"].addmm_(o["dxa"], o["A"]), 2 * wide + narrow),
        "dA = dxaᵀ x (bwd)": (lambda: o["dxa"].T @ o["x"], wide + narrow),
        "dha = s·dout B2 (bwd)": (lambda: (o["dout"] @ o["B2"]).mul_(s), wide + narrow // 2),
        "dB2 = s·doutᵀ ha (bwd)": (lambda: (o["dout"].T @ ha).mul_(s), wide + narrow // 2),
    }


def host_profile(fns: dict[str, Callable[[], object]]) -> dict[str, str]:
    """cProfile's top functions (cumulative host time) of each ``fn``, run once after a warm-up call."""
    import cProfile
    import io
    import pstats

    out = {}
    for name, fn in fns.items():
        fn()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        out[name] = buf.getvalue()
        print(f"== host profile: {name}\n{out[name]}", file=sys.stderr, flush=True)
    return out


def sweep(calls: dict, repeats: int) -> tuple[list[dict], dict[str, dict]]:
    """Every call over its kernel's grid; returns the rows and each kernel's tuned tile (lowest summed time)."""
    rows, best = [], {}
    for kernel, grid in GRIDS.items():
        names = [n for n, (k, _, _) in calls.items() if k == kernel]
        tiles = [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
        totals = []
        t0 = time.perf_counter()
        for tile in tiles:
            times = {}
            for name in names:
                try:
                    times[name] = median_ms(lambda: calls[name][1](**tile), repeats)
                except Exception as e:  # noqa: BLE001 - a tile Triton cannot build (shared memory) is a row
                    times[name] = None
                    rows.append({"call": name, "kernel": kernel, **tile, "error": f"{type(e).__name__}: {e}"[:160]})
            if all(t is not None for t in times.values()):
                totals.append((sum(times.values()), tile))
                rows += [{"call": n, "kernel": kernel, **tile, "ms": t} for n, t in times.items()]
        totals.sort(key=lambda x: x[0])
        for _, tile in totals[:2]:  # the two best at other pipeline depths
            for stages in STAGES:
                staged = {**tile, "num_stages": stages}
                try:
                    times = {n: median_ms(lambda: calls[n][1](**staged), repeats) for n in names}
                except Exception as e:  # noqa: BLE001
                    rows.append({"call": "+".join(names), "kernel": kernel, **staged, "error": str(e)[:160]})
                    continue
                totals.append((sum(times.values()), staged))
                rows += [{"call": n, "kernel": kernel, **staged, "ms": t} for n, t in times.items()]
        totals.sort(key=lambda x: x[0])
        best[kernel] = totals[0][1]
        print(f"  {kernel}: {len(tiles)} tiles in {time.perf_counter() - t0:.0f} s, best {best[kernel]} "
              f"({totals[0][0]:.3f} ms for {names})", file=sys.stderr, flush=True)
    return rows, best


def run(args: argparse.Namespace) -> dict:
    E, F, Lt, r = args.experts, args.width, args.latent, args.rank
    counts_cpu = expert_counts(E, args.tokens_per_expert)
    rows_n = int(counts_cpu.sum())
    counts = counts_cpu.to(DEVICE)
    o = operands(E, F, Lt, r, rows_n, counts)
    src = torch.empty(rows_n * F, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), args.repeats)
    copy_gbs = 2 * src.numel() * 2 / (copy_ms * 1e-3) / 1e9

    calls = kernel_calls(o, r)
    default, launch = {}, {}
    for name, (kernel, fn, nbytes) in calls.items():
        default[name] = median_ms(lambda: fn(), args.repeats)
        launch[name] = launch_us(lambda: fn())
    pairs = []
    for name, (one, two) in pair_calls(o, r).items():
        pairs.append({"calls": name, "one_launch_ms": median_ms(one, args.repeats),
                      "two_launches_ms": median_ms(two, args.repeats), "one_launch_host_us": launch_us(one),
                      "two_launches_host_us": launch_us(two)})
    sweep_rows, best = sweep(calls, args.repeats)
    per_call = []
    for name, (kernel, fn, nbytes) in calls.items():
        tuned = median_ms(lambda: fn(**best[kernel]), args.repeats)
        per_call.append({"call": name, "kernel": kernel, "bytes": nbytes, "floor_ms": nbytes / (copy_gbs * 1e9) * 1e3,
                         "default_ms": default[name], "tuned_ms": tuned, "host_us": launch[name],
                         "tuned_share_of_copy": nbytes / (tuned * 1e-3) / 1e9 / copy_gbs})

    sched_fns = {
        "torch ops (tile_schedule_reference + offsets)": lambda: (tile_schedule_reference(counts, rows_n, 64),
                                                                  row_offsets(counts)),
        "one Triton launch (row_tiles)": lambda: row_tiles(counts, rows_n, 64),
    }
    sched_ms = {k: {"device_ms": median_ms(f, args.repeats), "host_us": launch_us(f)} for k, f in sched_fns.items()}
    torch_rows = []
    for name, (fn, nbytes) in torch_calls(o, r).items():
        ms = median_ms(fn, args.repeats)
        torch_rows.append({"call": name, "bytes": nbytes, "ms": ms, "floor_ms": nbytes / (copy_gbs * 1e9) * 1e3,
                           "host_us": launch_us(fn)})

    # The module, default tiles vs tuned, against the base (one process, interleaved).
    base, tri = build(E, Lt, F, r, 64.0, DTYPE, DEVICE, fused=False)
    tri.lora_impl = "triton"
    x = torch.randn(rows_n, Lt, device=DEVICE).to(DTYPE).requires_grad_()
    dy = torch.randn(rows_n, Lt, device=DEVICE).to(DTYPE)
    saved = copy.deepcopy(DEFAULT_BLOCKS)
    sched = tile_schedule(counts, rows_n, DEFAULT_BLOCKS["expand"]["block_m"])

    def fwd_bwd(module, blocks=None):
        wrt = [x] + [getattr(module, n) for n in getattr(module, "factor_names", lambda: ())()]

        def step():
            if blocks is not None:
                for k, v in blocks.items():
                    DEFAULT_BLOCKS[k].update(v)
            try:
                torch.autograd.grad(module(x, counts), wrt, grad_outputs=dy)
            finally:
                for k, v in saved.items():
                    DEFAULT_BLOCKS[k].update(v)
        return step

    module_ms = time_side_by_side({"base": fwd_bwd(base), "triton default tiles": fwd_bwd(tri),
                                   "triton tuned tiles": fwd_bwd(tri, best)}, args.module_repeats, 3, DEVICE)
    for k, v in best.items():
        DEFAULT_BLOCKS[k].update(v)
    profile = kernel_table(fwd_bwd(tri), DEVICE, rows=40)
    host = host_profile({"expand gate, schedule given (x50)": lambda: [
        expand_add_(o["out"], o["xa2"][:, :r], o["B1"], counts, schedule=sched) for _ in range(50)],
        "module fwd+bwd (x5)": lambda: [fwd_bwd(tri)() for _ in range(5)]}) if args.host_profile else {}
    DEFAULT_BLOCKS.update(saved)
    print(profile, file=sys.stderr, flush=True)
    return {
        "bench": "gpu_lora_kernels", "torch": torch.__version__, "dtype": str(DTYPE),
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (Triton interpreter)",
        "triton": availability.triton.__version__,
        "shape": {"experts": E, "width": F, "latent": Lt, "rank": r, "rows": rows_n},
        "copy": {"ms": copy_ms, "gb_per_s": copy_gbs, "bytes": 2 * src.numel() * 2},
        "default_blocks": saved, "tuned_blocks": best, "calls": per_call, "pairs": pairs, "sweep": sweep_rows,
        "schedule_ms": sched_ms, "torch_calls": torch_rows, "module_fwd_bwd_ms": module_ms,
        "module_overhead": {k: v / module_ms["base"] - 1 for k, v in module_ms.items() if k != "base"},
        "profile_tuned": profile, "host_profile": host,
        "command": "python bench/gpu_lora_kernels.py " + " ".join(sys.argv[1:]),
    }


def markdown(res: dict) -> str:
    s, cp = res["shape"], res["copy"]
    lines = [f"# Rank-{s['rank']} LoRA kernels, {s['experts']} experts, {s['rows']} rows, F {s['width']}, Lt "
             f"{s['latent']}, {res['dtype']}, {res['device']} (torch {res['torch']}, triton {res['triton']}); D2D copy "
             f"{cp['gb_per_s']:.0f} GB/s", "",
             "Device times from CUDA-graph replays (no launch cost); host µs = the Python launch path per call.", "",
             "| call | kernel | MB moved | floor ms | default tile ms | tuned tile ms | tuned vs copy | host µs |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in res["calls"]:
        lines.append(f"| {c['call']} | {c['kernel']} | {c['bytes'] / 1e6:.0f} | {c['floor_ms']:.3f} | "
                     f"{c['default_ms']:.3f} | {c['tuned_ms']:.3f} | {100 * c['tuned_share_of_copy']:.0f}% | "
                     f"{c['host_us']:.0f} |")
    lines += ["", f"tuned tiles: {res['tuned_blocks']}", "",
              "| pair (default tiles) | one launch ms | two launches ms | one launch host µs "
              "| two launches host µs |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {p['calls']} | {p['one_launch_ms']:.3f} | {p['two_launches_ms']:.3f} | "
              f"{p['one_launch_host_us']:.0f} | {p['two_launches_host_us']:.0f} |" for p in res["pairs"]]
    lines += ["", "| schedule | device ms | host µs |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['device_ms']:.4f} | {v['host_us']:.0f} |" for k, v in res["schedule_ms"].items()]
    lines += ["", "| torch GEMM of the path | MB moved | floor ms | ms | host µs |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {t['call']} | {t['bytes'] / 1e6:.0f} | {t['floor_ms']:.3f} | {t['ms']:.3f} | {t['host_us']:.0f} |"
              for t in res["torch_calls"]]
    m, ov = res["module_fwd_bwd_ms"], res["module_overhead"]
    lines += ["", "| module fwd+bwd | ms | overhead vs base |", "|---|---:|---:|", f"| base | {m['base']:.3f} | |"]
    lines += [f"| {k} | {m[k]:.3f} | {100 * ov[k]:.1f}% |" for k in ov]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=112)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--tokens-per-expert", type=int, default=146)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per kernel and tile (median)")
    ap.add_argument("--module-repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", help="cuda; or cpu under TRITON_INTERPRET=1 (fp32, toy shapes)")
    ap.add_argument("--grid", choices=["full", "toy"], default="full", help="toy: two tiles per kernel")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of a kernel call and of "
                                                                  "the module's forward+backward")
    args = ap.parse_args(argv)
    global DEVICE, DTYPE
    DEVICE = torch.device(args.device)
    DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    if args.grid == "toy":
        for grid in GRIDS.values():
            grid["block_m"], grid["num_warps"] = [16, 32], [4]
            grid[next(k for k in grid if k not in ("block_m", "num_warps"))] = [16]
        STAGES[:] = [2]
    if not availability.triton_runs_on(DEVICE):
        raise SystemExit(f"bench/gpu_lora_kernels.py: the Triton kernels do not run on {DEVICE} here (CUDA, or the "
                         "CPU under TRITON_INTERPRET=1)")
    res = run(args)
    return report(res, markdown(res), args.out)


if __name__ == "__main__":
    main()
