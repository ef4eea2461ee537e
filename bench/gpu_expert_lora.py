"""Routed experts with shared-outer LoRA vs the frozen base experts alone, forward and forward+backward.

    python bench/gpu_expert_lora.py --out $OUT/gpu_expert_lora.json     # 112 experts (896 / EP8), K3 widths, r 32
    python bench/gpu_expert_lora.py --impls native --triton-block-m 32,128 --out $OUT/gpu_expert_lora_triton.json

The base is ``k3.model.moe.LatentExperts`` (w1/w3 ``[E, F, Lt]``, w2 ``[E, Lt, F]``, frozen); the adapted module
is ``k3.lora.experts.LoRALatentExperts`` built on copies of the same weights: ``fused`` (the adapters ride the base
grouped GEMMs as extra K/N columns, ``k3/kernels/expert_lora/folded.py``), ``plain`` (separate rank-r GEMMs and
full-width adds, the reference math and the module's default) and, where Triton runs (CUDA), ``triton`` (the plain
math with the rank-r grouped GEMMs on ``k3/kernels/expert_lora/triton.py``'s kernels, the adds in their epilogues;
``--triton-block-m 32,128`` adds rows with other row tiles). Rows are ``tokens_per_expert`` on average per
expert (a seeded multinomial, so the counts are uneven as a router's are), sorted by expert. Forward+backward is
``autograd.grad`` of the output against a fixed upstream gradient, w.r.t. the input rows (as in training, where
earlier layers have adapters too) and, with LoRA, the six adapter factors. Both modules run side by side in one
process, rotating which goes first; the overhead is ``LoRA / base - 1`` (goal <= 10% forward+backward).

Each grouped GEMM implementation is measured: ``native`` (``F.grouped_mm`` / ``torch._grouped_mm``) and
``padded`` (a batched matmul over experts padded to the largest count). Where torch has only the private
``torch._grouped_mm`` (no public ``F.grouped_mm``), ``k3.kernels.grouped_mm`` calls that, and the output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import platform
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py
from measure import elapsed_ms, report  # noqa: E402

import k3.kernels.expert_lora.folded as folded_mod
import k3.kernels.expert_lora.function as lora_function_mod
import k3.lora.experts as lora_experts_mod
import k3.model.moe as moe_mod
from k3.kernels import availability
from k3.kernels.expert_lora.triton import DEFAULT_BLOCKS
from k3.kernels.grouped_mm import grouped_mm, grouped_weight_grad, native_grouped_mm_supported
from k3.lora.experts import LoRALatentExperts
from k3.model.moe import LatentExperts

GOAL_OVERHEAD = 0.10
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # K3's activation_situ_beta / activation_situ_linear_beta
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def native_grouped_mm_shim() -> str:
    """Which native grouped GEMM ``k3.kernels.grouped_mm`` calls (it falls back to ``torch._grouped_mm``)."""
    if hasattr(F, "grouped_mm"):
        return "F.grouped_mm"
    return "torch._grouped_mm (no public F.grouped_mm in this torch)" if hasattr(torch, "_grouped_mm") else "none"


@contextlib.contextmanager
def forced_impl(impl: str) -> Iterator[None]:
    """Run the base and LoRA experts with one grouped GEMM implementation (``auto``, ``native``, ``padded``)."""
    forced = functools.partial(grouped_mm, impl=impl)
    saved = (moe_mod.grouped_mm, lora_experts_mod.grouped_mm, folded_mod.grouped_mm,
             folded_mod.grouped_weight_grad, lora_function_mod.grouped_mm)
    moe_mod.grouped_mm = lora_experts_mod.grouped_mm = folded_mod.grouped_mm = forced
    lora_function_mod.grouped_mm = forced  # the triton path's base GEMMs (its rank-r parts are Triton regardless)
    folded_mod.grouped_weight_grad = functools.partial(grouped_weight_grad, impl=impl)
    try:
        yield
    finally:
        (moe_mod.grouped_mm, lora_experts_mod.grouped_mm, folded_mod.grouped_mm,
         folded_mod.grouped_weight_grad, lora_function_mod.grouped_mm) = saved


@contextlib.contextmanager
def triton_block_m(block_m: int | None) -> Iterator[None]:
    """Run the Triton LoRA kernels with ``block_m`` rows per tile (all three kernels); None: their defaults."""
    saved = {k: v["block_m"] for k, v in DEFAULT_BLOCKS.items()}
    if block_m is not None:
        for v in DEFAULT_BLOCKS.values():
            v["block_m"] = block_m
    try:
        yield
    finally:
        for k, bm in saved.items():
            DEFAULT_BLOCKS[k]["block_m"] = bm


def triton_status(device: torch.device) -> str | None:
    """None where the Triton LoRA path runs on ``device``, else why not."""
    if availability.triton_runs_on(device):
        return None
    if not availability.triton_available():
        return "Triton is not importable"
    return f"the Triton kernels do not run on {device} (CUDA, or the CPU under TRITON_INTERPRET=1)"


def build(E: int, Lt: int, Fi: int, rank: int, alpha: float, dtype: torch.dtype, device: torch.device,
          seed: int = 0, fused: bool = True) -> tuple[LatentExperts, LoRALatentExperts]:
    """Base experts with random weights (std 0.02) and a LoRA module on a copy of them, B's nonzero.

    The copy keeps the base's weights contiguous (the fused LoRA moves its own into augmented storage)."""
    torch.manual_seed(seed)
    with torch.device(device):  # allocated and filled on the device: 3.7e9 weights are slow to fill on a CPU
        base = LatentExperts(E, Lt, Fi, SITU_BETA, SITU_LINEAR_BETA)
    with torch.no_grad():
        for p in (base.w1, base.w2, base.w3):
            p.normal_(0, 0.02)
    base = base.to(dtype=dtype)
    lora = LoRALatentExperts(copy.deepcopy(base), rank=rank, alpha=alpha, fused=fused)  # frozen w1/w2/w3
    with torch.no_grad():
        for name in ("w1_lora_B", "w3_lora_B", "w2_lora_B"):
            getattr(lora, name).normal_(0, 0.01)
    return base, lora


def expert_counts(E: int, tokens_per_expert: int, seed: int = 0) -> torch.Tensor:
    """``[E]`` int64 counts summing to ``E * tokens_per_expert``, each row's expert drawn uniformly."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, E, (E * tokens_per_expert,), generator=gen)
    return torch.bincount(experts, minlength=E)


def time_side_by_side(fns: dict[str, Callable], repeats: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median ms of each function, interleaved; the order rotates every repeat."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for n in names[i % len(names):] + names[:i % len(names)]:
            times[n].append(elapsed_ms(fns[n], device))
    return {n: statistics.median(t) for n, t in times.items()}


def kernel_table(fn: Callable[[], object], device: torch.device, rows: int = 14) -> str:
    """torch.profiler's per-kernel table (device time, top ``rows``) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    native = native_grouped_mm_shim()
    E, Lt, Fi, r = args.experts, args.latent, args.width, args.rank
    base, fused = build(E, Lt, Fi, r, args.alpha, dtype, device)
    plain = LoRALatentExperts(copy.deepcopy(base), rank=r, alpha=args.alpha, fused=False)
    with torch.no_grad():  # the same adapter values in both LoRA modules
        for n in fused.factor_names():
            getattr(plain, n).copy_(getattr(fused, n))
    loras = {"fused": fused}
    for layout in args.fused_layouts:  # extra fused variants: "<slot multiple><s|x>", s = shared input buffer
        m = copy.deepcopy(fused)
        m.slot_multiple, m.shared_input = int(layout[:-1]), layout[-1] == "s"
        loras[f"fused {layout}"] = m
    loras["plain"] = plain
    block_m_of: dict[str, int | None] = {}  # the Triton LoRA paths and their row tile
    no_triton = triton_status(device)
    if no_triton is None:
        triton_lora = copy.deepcopy(plain)  # one module (one more copy of the base weights) for every row tile
        triton_lora.lora_impl = "triton"
        for bm in [None, *args.triton_block_m]:
            name = "triton" if bm is None else f"triton bm{bm}"
            loras[name], block_m_of[name] = triton_lora, bm
    else:
        print(f"  no triton LoRA path: {no_triton}", file=sys.stderr, flush=True)
    counts_cpu = expert_counts(E, args.tokens_per_expert)
    counts = counts_cpu.to(device)
    rows = int(counts_cpu.sum())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, Lt, generator=gen, device=device).to(dtype).requires_grad_()
    dy = torch.randn(rows, Lt, generator=gen, device=device).to(dtype)

    def fwd(module, block_m=None):
        def step():
            with torch.no_grad(), triton_block_m(block_m):
                return module(x, counts)
        return step

    def fwd_bwd(module, block_m=None):
        wrt = [x] + [getattr(module, n) for n in getattr(module, "factor_names", lambda: ())()]

        def step():
            with triton_block_m(block_m):
                torch.autograd.grad(module(x, counts), wrt, grad_outputs=dy)
        return step

    flops_fwd = 2 * rows * Lt * Fi * 3  # three GEMMs of the base
    results = []
    outputs = {}
    failed_paths: set[str] = set()
    for impl in args.impls:
        if impl == "native" and not native_grouped_mm_supported(x.detach(), base.w1):
            results.append({"impl": impl, "skipped": f"native grouped GEMM unsupported here ({native}, {dtype})"})
            continue
        try:
            with forced_impl(impl):
                paths = dict(loras)
                for name in [n for n in paths if n in block_m_of]:
                    try:  # a Triton path compiles here; one that fails must not cost the other paths' numbers
                        fwd_bwd(paths[name], block_m_of[name])()
                    except Exception as e:  # noqa: BLE001 - recorded as that path's row
                        del paths[name]
                        failed_paths.add(name)
                        results.append({"impl": impl, "lora": name,
                                        "skipped": f"{name} failed: {type(e).__name__}: {str(e)[:200]}"})
                        print(f"  {impl}/{name}: failed: {e!r}", file=sys.stderr, flush=True)
                fns = {"base_fwd": fwd(base), "base_fwd_bwd": fwd_bwd(base)}
                for name, m in paths.items():
                    bm = block_m_of.get(name)
                    fns[f"{name}_fwd"], fns[f"{name}_fwd_bwd"] = fwd(m, bm), fwd_bwd(m, bm)
                k = args.back_to_back  # k calls per timed sample: the host's launches overlap earlier calls' work
                fns = {n: (lambda f=f: [f() for _ in range(k)]) for n, f in fns.items()}
                t = {n: ms / k for n, ms in time_side_by_side(fns, args.repeats, args.warmup, device).items()}
                for name, m in paths.items():
                    outputs[f"{impl}/{name}"] = fwd(m, block_m_of.get(name))().float()
        except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others' numbers
            results.append({"impl": impl, "skipped": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            print(f"  {impl}: failed: {e!r}", file=sys.stderr, flush=True)
            continue
        for name in paths:
            over_fb = t[f"{name}_fwd_bwd"] / t["base_fwd_bwd"] - 1
            results.append({
                "impl": impl, "lora": name, "base_fwd_ms": t["base_fwd"], "lora_fwd_ms": t[f"{name}_fwd"],
                "base_fwd_bwd_ms": t["base_fwd_bwd"], "lora_fwd_bwd_ms": t[f"{name}_fwd_bwd"],
                "overhead_fwd": t[f"{name}_fwd"] / t["base_fwd"] - 1, "overhead_fwd_bwd": over_fb,
                "base_fwd_tflops": flops_fwd / (t["base_fwd"] * 1e-3) / 1e12,
                "goal_overhead_fwd_bwd": GOAL_OVERHEAD, "meets_goal": over_fb <= GOAL_OVERHEAD,
            })
        print(f"  {impl}: {t}", file=sys.stderr, flush=True)
    profiles = {}
    if args.profile:
        with forced_impl(args.impls[0]):
            for name, m in {"base": base, **loras}.items():
                if name in failed_paths:
                    continue
                profiles[name] = kernel_table(fwd_bwd(m, block_m_of.get(name)), device)
                print(f"== profile {name} fwd+bwd ({args.impls[0]})\n{profiles[name]}", file=sys.stderr, flush=True)
    agreement = []
    if outputs:
        ref_name = next(iter(outputs))
        ref = outputs[ref_name]
        for name, out in list(outputs.items())[1:]:
            agreement.append({"pair": f"{name} vs {ref_name}", "rel": float((out - ref).norm() / ref.norm()),
                              "max_abs": float((out - ref).abs().max())})
    return {
        "bench": "gpu_expert_lora",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "native_grouped_mm": native, "dtype": args.dtype,
        "shape": {"experts": E, "latent": Lt, "width": Fi, "rank": r, "alpha": args.alpha, "rows": rows,
                  "tokens_per_expert_mean": rows / E, "tokens_per_expert_max": int(counts_cpu.max()),
                  "tokens_per_expert_min": int(counts_cpu.min())},
        "triton_lora": {"runs": no_triton is None, "why_not": no_triton,
                        "triton": getattr(availability.triton, "__version__", None),
                        "default_blocks": copy.deepcopy(DEFAULT_BLOCKS),
                        "block_m": {n: bm for n, bm in block_m_of.items()}},
        "repeats": args.repeats, "warmup": args.warmup, "back_to_back": args.back_to_back, "results": results, "lora_output_agreement": agreement,
        "profiles": profiles,
        "command": "python bench/gpu_expert_lora.py " + " ".join(sys.argv[1:]),
    }


def markdown(result: dict) -> str:
    s = result["shape"]
    lines = [(f"# Routed experts + shared-outer LoRA r={s['rank']} vs base, {s['experts']} experts, latent "
              f"{s['latent']}, width {s['width']}, {s['rows']} rows ({s['tokens_per_expert_min']}-"
              f"{s['tokens_per_expert_max']} per expert), {result['dtype']} on {result['device']} (torch "
              f"{result['torch']}; native grouped GEMM: {result['native_grouped_mm']}); "
              f"{result['back_to_back']} call(s) back to back per timed sample"), "",
             ("| grouped GEMM | LoRA path | base fwd ms | LoRA fwd ms | fwd overhead | base fwd+bwd ms | "
              "LoRA fwd+bwd ms | fwd+bwd overhead | goal <= 10% | base fwd TFLOP/s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in result["results"]:
        if "skipped" in r:
            lines.append(f"| {r['impl']} | {r.get('lora', '')} | {r['skipped']} | | | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['lora']} | {r['base_fwd_ms']:.3f} | {r['lora_fwd_ms']:.3f} | "
                     f"{100 * r['overhead_fwd']:.1f}% | {r['base_fwd_bwd_ms']:.3f} | {r['lora_fwd_bwd_ms']:.3f} | "
                     f"{100 * r['overhead_fwd_bwd']:.1f}% | {'yes' if r['meets_goal'] else 'NO'} | "
                     f"{r['base_fwd_tflops']:.0f} |")
    if not result["triton_lora"]["runs"]:
        lines += ["", f"No triton LoRA path: {result['triton_lora']['why_not']}"]
    for a in result["lora_output_agreement"]:
        lines += ["", f"LoRA output {a['pair']}: relative {a['rel']:.2e}, max abs {a['max_abs']:.2e}"]
    return "\n".join(lines)


def shape_arguments(ap: argparse.ArgumentParser, repeats: int = 10) -> argparse.ArgumentParser:
    """The routed-expert shape, timing, device and output options (shared with bench/gpu_grouped_mm.py)."""
    ap.add_argument("--experts", type=int, default=112)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--tokens-per-expert", type=int, default=146)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap


def parser() -> argparse.ArgumentParser:
    ap = shape_arguments(argparse.ArgumentParser(description=__doc__,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--impls", type=lambda s: s.split(","), default=["native", "padded"],
                    help="comma-separated grouped GEMM implementations: native, padded, auto")
    ap.add_argument("--fused-layouts", type=lambda s: [t for t in s.split(",") if t], default=[],
                    help="extra fused-path layouts to time, comma-separated <slot multiple><s|x>: e.g. 64s = K/N "
                         "rounded up to a multiple of 64, gate/up sharing one input buffer; 128x = separate buffers")
    ap.add_argument("--triton-block-m", type=lambda s: [int(t) for t in s.split(",") if t], default=[],
                    help="extra triton LoRA paths to time, comma-separated rows per tile for all three kernels "
                         "(powers of two >= 16; the default tile is always timed)")
    ap.add_argument("--back-to-back", type=int, default=1,
                    help="calls per timed sample, back to back (the time is per call): 1 times each call from an idle "
                         "device, so the host's work before its first kernel counts; more let the host's launches "
                         "overlap the previous call's device work, as the layers of a training step do")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's kernel table of one forward+backward of each module")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = run(args)
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
