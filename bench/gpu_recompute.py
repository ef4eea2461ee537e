"""Activation recompute on one GPU: peak memory of a LoRA training step with and without megatron's recompute.

    python bench/gpu_recompute.py --out $OUT/gpu_recompute.json       # K3 width, 4 layers, 8192 packed tokens
    python bench/gpu_recompute.py --seq-len 4096 --modes none,full

A K3 slice at the real width (hidden 7168, KDA 96 × 128 heads, MLA 96 heads, the 4layer variant's layer kinds:
KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE) with fewer routed experts (``--experts``, top ``--topk``) and a smaller
vocabulary so it fits one GPU, BF16, LoRA rank 32 on the recipe's targets. One micro-batch of ``--seq-len`` tokens
packed as ``--sequences`` equal sequences (the recipe's ``max_tokens_per_gpu`` 8192 by default), megatron's THD
path. For each mode the same model (same seed) runs a warm-up step and then a measured forward + backward:
``torch.cuda.max_memory_allocated`` above the memory held before the step (the activations, the logits and the
gradients), the step time, and the LoRA gradients' largest relative difference from ``none`` (recompute must not
change them beyond BF16 run-to-run noise). Modes: ``none``, ``full`` (uniform, 1 layer: the recipe's), ``full_block``
(block, 2 layers), ``selective`` (core_attn), ``selective_all`` (core_attn, layernorm, mlp, moe, shared_experts).
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py
from measure import report  # noqa: E402

from k3.config import variant
from k3.lora import LoRAConfig
from k3.megatron.config import k3_transformer_config
from k3.megatron.lora import apply_megatron_lora
from k3.megatron.model import k3_model_provider
from k3.megatron.packed import packed_seq_params
from k3.megatron.packing import packed_bounds
from k3.megatron.parallel import init_parallel
from k3.megatron.recompute import Recompute
from k3.rl.step_profile import profile_call, summary_text
from k3.settings.parallel import ParallelLayout

MODES = {
    "none": Recompute(),
    "full": Recompute("full", "uniform", 1),
    "full_block": Recompute("full", "block", 2),
    "selective": Recompute("selective"),
    "selective_all": Recompute("selective", modules=("core_attn", "layernorm", "mlp", "moe", "shared_experts")),
}
GIB = 2**30


def k3_slice(experts: int, topk: int, vocab: int):
    """The 4layer variant (full width) with ``experts`` routed experts, top ``topk``, and a ``vocab`` vocabulary."""
    return variant("4layer").replace(quantization_config=None, num_experts=experts, num_experts_per_token=topk,
                                     vocab_size=vocab)


def one_mode(name: str, cfg, ids: torch.Tensor, labels: torch.Tensor, cu: torch.Tensor, rank: int,
             profile: int = 0) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = k3_transformer_config(cfg, params_dtype=torch.bfloat16, use_cpu_initialization=False,
                                   recompute=MODES[name])
    with torch.device("cuda"):  # initialise on the GPU: billions of parameters
        model = k3_model_provider(config)
    apply_megatron_lora(model, LoRAConfig(rank=rank, alpha=2 * rank), seed=0)
    with torch.no_grad():  # B = 0 would leave A without a gradient
        gen = torch.Generator(device="cuda").manual_seed(1)
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(0.01 * torch.randn(p.shape, device="cuda", generator=gen))
    params = packed_seq_params(cu, "cuda")
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.train()

    def step() -> None:
        logits = model(ids, None, None, packed_seq_params=params)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
        loss.backward()
        del logits, loss

    step()  # warm-up: kernels compiled, autotuned
    for p in lora.values():
        p.grad = None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    grads = {n: p.grad.float().cpu() for n, p in lora.items()}
    with torch.no_grad():  # the forward alone, as the trainer's log-prob pass runs it
        model(ids, None, None, packed_seq_params=params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, None, None, packed_seq_params=params)
        torch.cuda.synchronize()
        forward_s = time.perf_counter() - t0
    kernels = None
    if profile:  # where the step's time goes: the top kernels and the code that launched them
        _, kernels = profile_call(step, top=profile)
    model = lora = params = None  # freed before the next mode builds its model (the closure holds them too)
    gc.collect()
    torch.cuda.empty_cache()
    return {"mode": name, "held_gib": held / GIB, "peak_gib": peak / GIB, "step_peak_gib": (peak - held) / GIB,
            "step_s": seconds, "forward_s": forward_s, "top_kernels": kernels, "grads": grads}


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_recompute.py needs a CUDA GPU")
    init_parallel(ParallelLayout.model_parallel())
    cfg = k3_slice(args.experts, args.topk, args.vocab)
    lengths = [args.seq_len // args.sequences] * args.sequences
    cu = packed_bounds(lengths)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, int(cu[-1]) + 1), generator=gen)
    ids, labels = tokens[:, :-1].cuda(), tokens[:, 1:].cuda()
    rows, base = [], None
    for name in args.modes.split(","):
        r = one_mode(name, cfg, ids, labels, cu, args.rank, args.profile)
        grads = r.pop("grads")
        if base is None:
            base = grads
        r["grad_max_rel_vs_first"] = max(((grads[k] - g).norm() / g.norm().clamp_min(1e-30)).item()
                                         for k, g in base.items())
        rows.append(r)
        print(f"{name}: step peak {r['step_peak_gib']:.2f} GiB, step {r['step_s']:.2f} s, forward "
              f"{r['forward_s']:.2f} s", flush=True)
        if r["top_kernels"] is not None:
            print(summary_text(r["top_kernels"], f"{name}: one profiled step"), flush=True)
    first = rows[0]["step_peak_gib"]
    for r in rows:
        r["step_peak_vs_first"] = r["step_peak_gib"] / first
    table = ["| mode | held GiB | step peak GiB | vs first | step s | forward s | LoRA grad rel. diff |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['mode']} | {r['held_gib']:.2f} | {r['step_peak_gib']:.2f} | {r['step_peak_vs_first']:.2f} | "
              f"{r['step_s']:.2f} | {r['forward_s']:.2f} | {r['grad_max_rel_vs_first']:.1e} |" for r in rows]
    result = {
        "bench": "gpu_recompute",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
                  "topk": cfg.num_experts_per_token, "vocab": cfg.vocab_size, "tokens": int(cu[-1]),
                  "sequences": args.sequences, "lora_rank": args.rank, "dtype": "bfloat16"},
        "rows": rows,
    }
    return report(result, "\n".join(table), args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192, help="tokens in the packed micro-batch")
    p.add_argument("--sequences", type=int, default=4, help="sequences packed into it (equal lengths)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile one more step per mode and list its N most expensive CUDA kernels, with the "
                        "operators and code that launched them (k3.rl.step_profile)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    run(p.parse_args())


if __name__ == "__main__":
    main()
