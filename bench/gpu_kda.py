"""KDA core on CUDA: our dispatch (``k3.kernels.kda.fla``) vs the raw fla call it wraps, side by side in one process.

    python bench/gpu_kda.py --out $OUT/gpu_kda.json                  # T 8192, 96 heads x 128, BF16 (K3 shapes)
    python bench/gpu_kda.py --seq-len 2048 --repeats 5

Each case times ours and the raw ``fla.ops.kda`` call on the same tensors, alternating which goes first, and
reports the medians (CUDA events) and ``ours / raw`` (goal <= 1.05, issue #7). Inputs are what fla takes (q, k, v
BF16, g and beta float32, float32 state) plus one case with q/k float32 as the layer's L2 norm returns them, which
our dispatch casts. Forward+backward times ``autograd.grad`` of (o, final state) w.r.t. every input. An accuracy
block compares our forward with the torch chunked core in float32 on the same inputs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py
from measure import elapsed_ms, report  # noqa: E402

from k3.kernels.kda import fla as kda_mod
from k3.kernels.kda.fla import kda_core, kda_core_with_gate
from k3.kernels.kda.gate import kda_gate

GOAL = 1.05
LOWER_BOUND = -5.0


def time_side_by_side(ours: Callable, raw: Callable, repeats: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Median ms of ``ours`` and ``raw``, interleaved (the first of each pair alternates)."""
    for _ in range(warmup):
        ours()
        raw()
    t_ours, t_raw = [], []
    for i in range(repeats):
        pair = [(ours, t_ours), (raw, t_raw)]
        for fn, acc in pair if i % 2 == 0 else pair[::-1]:
            acc.append(elapsed_ms(fn, device))
    return statistics.median(t_ours), statistics.median(t_raw)


def make_inputs(B: int, T: int, H: int, D: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """K3-like inputs: unit q/k, K3's bounded gate, the raw gate logit and its parameters, a float32 state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q32 = F.normalize(randn(B, T, H, D), dim=-1)
    k32 = F.normalize(randn(B, T, H, D), dim=-1)
    z = randn(B, T, H, D)
    A_log, dt_bias = randn(H) * 0.5, randn(H * D)
    g = kda_gate(z, A_log, dt_bias, LOWER_BOUND)
    return {
        "q": q32.bfloat16(), "k": k32.bfloat16(), "q32": q32, "k32": k32, "v": randn(B, T, H, D).bfloat16(),
        "g": g, "z": z, "A_log": A_log, "dt_bias": dt_bias, "beta": torch.rand(B, T, H, generator=gen, device=device),
        "s0": randn(B, H, D, D),
    }


def fwd_bwd(call: Callable, leaves: list[torch.Tensor], do: torch.Tensor, ds: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        o, s = call()
        torch.autograd.grad((o, s), leaves, grad_outputs=(do, ds), allow_unused=True)
    return step


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    ops = kda_mod._fla_ops()
    if ops is None:
        raise SystemExit("bench/gpu_kda.py needs flash-linear-attention with Triton (the .whl wheels) and CUDA")
    fla_chunk, fla_fused = ops
    B, T, H, D = 1, args.seq_len, args.heads, args.head_dim
    x = make_inputs(B, T, H, D, device)
    scale = D**-0.5
    leaves = {n: x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta", "s0", "z", "A_log", "dt_bias",
                                                  "q32", "k32")}
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(B, T, H, D, generator=gen, device=device).bfloat16()
    ds = torch.randn(B, H, D, D, generator=gen, device=device)
    q, k, v, g, beta, s0 = (leaves[n] for n in ("q", "k", "v", "g", "beta", "s0"))
    z, A_log, dt_bias = leaves["z"], leaves["A_log"], leaves["dt_bias"]
    plain = [q, k, v, g, beta, s0]
    n_seq = args.packed_sequences
    bounds = [round(i * T / n_seq) for i in range(n_seq + 1)]
    cu_cpu = torch.tensor(bounds, dtype=torch.long)
    cu_dev = cu_cpu.to(device)
    s0_packed = torch.randn(n_seq, H, D, D, generator=gen, device=device).requires_grad_()
    ds_packed = torch.randn(n_seq, H, D, D, generator=gen, device=device)
    gate_kw = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias, "lower_bound": LOWER_BOUND}

    cases: list[tuple[str, Callable, Callable]] = [
        ("forward", lambda: kda_core(q, k, v, g, beta, scale, s0, backend="fla"),
         lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True)),
        ("forward+backward",
         fwd_bwd(lambda: kda_core(q, k, v, g, beta, scale, s0, backend="fla"), plain, do, ds),
         fwd_bwd(lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True),
                 plain, do, ds)),
        ("forward+backward, q/k float32 (the layer's dtypes; ours casts)",
         fwd_bwd(lambda: kda_core(leaves["q32"], leaves["k32"], v, g, beta, scale, s0, backend="fla"),
                 [leaves["q32"], leaves["k32"], v, g, beta, s0], do, ds),
         fwd_bwd(lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True),
                 plain, do, ds)),
        ("forward+backward, safe_gate (bound -5)",
         fwd_bwd(lambda: kda_core(q, k, v, g, beta, scale, s0, backend="fla", gate_lower_bound=LOWER_BOUND),
                 plain, do, ds),
         fwd_bwd(lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True,
                                   safe_gate=True), plain, do, ds)),
        ("forward+backward, gate fused (lower_bound -5, safe_gate)",
         fwd_bwd(lambda: kda_core_with_gate(q, k, v, z, beta, A_log, dt_bias, LOWER_BOUND, scale, s0,
                                            backend="fla"), [q, k, v, z, beta, s0, A_log, dt_bias], do, ds),
         fwd_bwd(lambda: fla_chunk(q, k, v, z, beta, scale=scale, initial_state=s0, output_final_state=True,
                                   safe_gate=True, **gate_kw), [q, k, v, z, beta, s0, A_log, dt_bias], do, ds)),
        (f"forward+backward, {n_seq} packed sequences (cu_seqlens)",
         fwd_bwd(lambda: kda_core(q, k, v, g, beta, scale, s0_packed, backend="fla", cu_seqlens=cu_cpu),
                 [q, k, v, g, beta, s0_packed], do, ds_packed),
         fwd_bwd(lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0_packed, output_final_state=True,
                                   cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu),
                 [q, k, v, g, beta, s0_packed], do, ds_packed)),
    ]
    # decode: one token for each of a batch of sequences, no gradient (fused_recurrent_kda)
    dec = make_inputs(args.decode_batch, 1, H, D, device, seed=2)
    dq, dk, dv, dg, dbeta, ds0 = (dec[n] for n in ("q", "k", "v", "g", "beta", "s0"))

    def decode_ours():
        with torch.no_grad():
            return kda_core(dq, dk, dv, dg, dbeta, scale, ds0, backend="fla")

    def decode_raw():
        with torch.no_grad():
            return fla_fused(dq, dk, dv, dg, dbeta, scale=scale, initial_state=ds0, output_final_state=True)

    cases.append((f"decode, batch {args.decode_batch} x 1 token", decode_ours, decode_raw))

    rows = []
    for name, ours, raw in cases:
        t_ours, t_raw = time_side_by_side(ours, raw, args.repeats, args.warmup, device)
        goal = None if name.startswith("decode") else GOAL  # decode is launch-bound: reported, no goal
        rows.append({"case": name, "ours_ms": t_ours, "raw_fla_ms": t_raw, "ratio": t_ours / t_raw,
                     "goal": goal, "meets_goal": None if goal is None else t_ours / t_raw <= goal})
        print(f"  {name}: ours {t_ours:.3f} ms, raw {t_raw:.3f} ms", file=sys.stderr, flush=True)

    with torch.no_grad():
        o, s = kda_core(q, k, v, g, beta, scale, s0, backend="fla")
        o_ref, s_ref = kda_core(q.float(), k.float(), v.float(), g, beta, scale, s0, backend="torch_chunk")
        o_raw, s_raw = fla_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True)
    accuracy = {
        "o_max_abs_vs_torch_fp32": float((o.float() - o_ref).abs().max()),
        "o_rel_vs_torch_fp32": float((o.float() - o_ref).norm() / o_ref.norm()),
        "state_max_abs_vs_torch_fp32": float((s - s_ref).abs().max()),
        "state_rel_vs_torch_fp32": float((s - s_ref).norm() / s_ref.norm()),
        "o_identical_to_raw_fla": bool(torch.equal(o, o_raw.to(o.dtype))),
        "state_identical_to_raw_fla": bool(torch.equal(s, s_raw.float())),
    }
    return {
        "bench": "gpu_kda", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or "cpu", "torch": torch.__version__, "fla": _fla_version(),
        "shape": {"batch": B, "seq_len": T, "heads": H, "head_dim": D, "dtype": "bfloat16",
                  "packed_sequences": n_seq, "decode_batch": args.decode_batch},
        "repeats": args.repeats, "warmup": args.warmup, "rows": rows, "accuracy": accuracy,
        "command": "python bench/gpu_kda.py " + " ".join(sys.argv[1:]),
    }


def _fla_version() -> str:
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution (e.g. a stand-in)
        return "unknown"


def markdown(result: dict) -> str:
    s = result["shape"]
    title = (f"# KDA core: ours vs raw fla on {result['device']} (torch {result['torch']}, fla {result['fla']}); "
             f"B={s['batch']} T={s['seq_len']} H={s['heads']} K=V={s['head_dim']} BF16, median of "
             f"{result['repeats']}")
    lines = [title,
             "", "| case | ours ms | raw fla ms | ours / raw | goal <= 1.05 |", "|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        verdict = "n/a" if r["meets_goal"] is None else "yes" if r["meets_goal"] else "NO"
        lines.append(f"| {r['case']} | {r['ours_ms']:.3f} | {r['raw_fla_ms']:.3f} | {r['ratio']:.3f} | {verdict} |")
    a = result["accuracy"]
    note = (f"forward vs torch chunked core (float32, same inputs): o max abs {a['o_max_abs_vs_torch_fp32']:.2e} "
            f"(rel {a['o_rel_vs_torch_fp32']:.2e}), state max abs {a['state_max_abs_vs_torch_fp32']:.2e} (rel "
            f"{a['state_rel_vs_torch_fp32']:.2e}); identical to the raw fla call: o {a['o_identical_to_raw_fla']}, "
            f"state {a['state_identical_to_raw_fla']}")
    lines += ["", note]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--packed-sequences", type=int, default=4)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = run(args)
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
