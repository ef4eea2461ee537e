"""The embedded engine's decode: ms per step at batch 8 and 64 against the bandwidth limit measured in the same run,
prefill tokens/s, for each decode path side by side; JSON with ``--out``.

    python bench/embedded_decode.py --out $OUT/embedded_decode.json     # a CUDA GPU: the 4layer width, 32 experts
    python bench/embedded_decode.py --tiny                              # CPU sanity run (tiny model, seconds)

The model is the 4layer variant at its real width (hidden 7168, KDA 96 × 128 heads, MLA 96 heads, latent 512 +
64; KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE) with its routed experts cut to ``--experts`` (issue #21 measured 32: 8.36 B
parameters, 16.7 GB in BF16), random weights, BF16 on CUDA (float32 on CPU). Every request has a ``--prompt-len``
prompt and decodes greedily, never stopping (the tokenizer's eos is outside the vocabulary).

Paths (``DecodeSettings``): ``eager`` (the grown reference cache, a checked forward per step), ``static`` (the
preallocated cache at host positions), ``window`` (its device position, absorbed MLA in torch, no graph), ``graph``
(window + CUDA graphs, torch MLA attention and sampler), ``fused`` (graph with RMSNorm, SiTU, the AttnRes mix and
KDA's head norms as one Triton kernel each), ``flashinfer`` (graph + flashinfer's MLA kernel and sampler), ``auto`` (what the engine
takes by default here). A path that cannot run here is reported with the reason.

Decode ms/step is ``(t(n₂) − t(n₁)) / (n₂ − n₁)`` over two ``generate`` calls of n₁ = 4 and n₂ = 4 + ``--steps`` new
tokens (prefill and per-call costs cancel), the best of ``--repeats``. The limit: the weight bytes one step reads
(every parameter but the embedding table; of the routed experts the expected share a batch touches,
``1 − (1 − k/E)^B`` per layer, uniform routing) over the copy bandwidth (bytes read + written per second by one
large device-to-device copy): ``ratio = limit_ms / ms_per_step`` (1 = at the bandwidth limit). Prefill: one forward
of ``--prefill-tokens`` tokens in one sequence (after a warm-up call), tokens/s.

``--profile``: where a step's time goes, for every timed path at the largest batch. torch.profiler records the same
two ``generate`` calls (n₁ and n₂ new tokens), and each kernel's time per step is its difference over the
``--steps`` tokens between them, as for the step itself (on CUDA the device kernels CUPTI reports, which should
include those a CUDA graph replays: not yet seen on a GPU; on CPU the operators' own time). The table lists the largest; "kernels / step" is their sum over all names, which
against ms/step says how much of a step the device is busy (the rest: gaps between kernels, host work).
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
from measure import elapsed_ms, report  # noqa: E402

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.model import KimiK3ForCausalLM
from k3.model.moe import LatentExperts
from k3.rollout.embedded.engine import EmbeddedEngine
from k3.rollout.protocol import GenerateRequest, SamplingParams
from k3.settings.decode import DecodeSettings

PATHS = {
    "eager": DecodeSettings(mode="eager", sampler="torch"),
    "static": DecodeSettings(mode="static", sampler="torch"),
    "window": DecodeSettings(mode="window", mla_kernel="torch", sampler="torch", small_ops="torch"),
    "graph": DecodeSettings(mode="graph", mla_kernel="torch", sampler="torch", small_ops="torch"),
    "fused": DecodeSettings(mode="graph", mla_kernel="torch", sampler="torch", small_ops="triton"),
    "flashinfer": DecodeSettings(mode="graph", mla_kernel="flashinfer", sampler="flashinfer", small_ops="torch"),
    "auto": DecodeSettings(),
}
FIRST_CALL_TOKENS = 4


class BenchTokenizer:
    """Token ids as they are; eos outside the vocabulary, so no request stops early."""

    def __init__(self, vocab_size: int) -> None:
        self.eos_id, self.pad_id = vocab_size, 0

    def decode(self, ids: list[int]) -> str:
        return ""


def bench_config(tiny: bool, experts: int, topk: int | None, vocab: int | None):
    if tiny:
        return variant("tiny").replace(quantization_config=None)
    cfg = variant("4layer").replace(quantization_config=None, num_experts=experts)
    if topk is not None:
        cfg = cfg.replace(num_experts_per_token=topk)
    if vocab is not None:
        cfg = cfg.replace(vocab_size=vocab)
    return cfg


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by one device-to-device copy of ``nbytes``, the best of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(elapsed_ms(lambda: dst.copy_(src), device) for _ in range(repeats))
    del src, dst
    return 2 * nbytes / (best / 1e3)


def weight_bytes_per_step(model: torch.nn.Module, batch: int, topk: int) -> int:
    """Parameter bytes a decode step of ``batch`` rows reads (see the module docstring)."""
    total = 0
    for name, module in model.named_modules():
        own = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if isinstance(module, LatentExperts):
            E = module.num_experts
            total += int(own * (1 - (1 - min(topk, E) / E) ** batch))
        elif isinstance(module, torch.nn.Embedding):
            total += batch * module.weight.shape[1] * module.weight.element_size()
        else:
            total += own
    return total


def decode_ms_per_step(engine: EmbeddedEngine, prompts: list[list[int]], steps: int,
                       repeats: int) -> tuple[float, list]:
    reqs = [GenerateRequest(p) for p in prompts]

    def timed(n: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=n))
        return (time.perf_counter() - t0) * 1e3, out

    timed(FIRST_CALL_TOKENS + steps)  # the cache at the longer length, graph capture, JIT: none of it timed
    best_short = min(timed(FIRST_CALL_TOKENS)[0] for _ in range(repeats))
    runs = [timed(FIRST_CALL_TOKENS + steps) for _ in range(repeats)]
    best_long = min(t for t, _ in runs)
    return (best_long - best_short) / steps, [s.tokens for s in runs[-1][1]]


def _op_times_us(engine: EmbeddedEngine, prompts: list[list[int]], n: int) -> dict[str, tuple[int, float]]:
    """``{name: (calls, µs)}`` of one ``generate`` of ``n`` new tokens: the device kernels on CUDA, the operators'
    own CPU time on CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    reqs = [GenerateRequest(p) for p in prompts]
    with profile(activities=activities) as prof:
        engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=n))
        if cuda:
            torch.cuda.synchronize(engine.device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return {e.key: (e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
            for e in prof.key_averages() if e.device_type == kind}


def step_profile(engine: EmbeddedEngine, prompts: list[list[int]], steps: int, top: int = 20) -> dict:
    """Per decode step, each kernel's calls and µs: the difference between ``generate`` calls of
    ``FIRST_CALL_TOKENS + steps`` and ``FIRST_CALL_TOKENS`` new tokens over ``steps``; the ``top`` largest, and the
    sum over every name (``kernel_us_per_step``). A name whose time difference comes out negative (timing noise:
    no operator takes negative time) counts 0."""
    short = _op_times_us(engine, prompts, FIRST_CALL_TOKENS)
    long = _op_times_us(engine, prompts, FIRST_CALL_TOKENS + steps)
    per_step = {}
    for name, (calls, us) in long.items():
        calls0, us0 = short.get(name, (0, 0.0))
        per_step[name] = {"calls": (calls - calls0) / steps, "us": max(0.0, (us - us0) / steps)}
    ranked = sorted(per_step.items(), key=lambda item: -item[1]["us"])
    return {"kernel_us_per_step": sum(v["us"] for v in per_step.values()),
            "top": [{"name": name, **v} for name, v in ranked[:top]]}


def prefill_tokens_per_s(model: KimiK3ForCausalLM, tokens: int, vocab: int, device: torch.device) -> float:
    ids = torch.randint(1, vocab, (1, tokens), device=device, generator=torch.Generator(device).manual_seed(0))

    def run() -> None:
        with torch.no_grad():
            model.lm_head(model.model(ids)[:, -1])

    run()  # Triton compile and autotune on the first call
    return tokens / (min(elapsed_ms(run, device) for _ in range(2)) / 1e3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny variant (CPU sanity run)")
    ap.add_argument("--experts", type=int, default=32, help="routed experts of the 4layer width (issue #21: 32)")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (default: the variant's)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the variant's)")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on the recipe's targets (0: none)")
    ap.add_argument("--batches", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 128; tiny 8)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; tiny 8)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill length (default 4096; tiny 64)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copy-mib", type=int, default=None, help="copy size for the bandwidth (default 2048; tiny 64)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each path at the largest batch: each kernel's time per decode step")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt_len = args.prompt_len or (8 if args.tiny else 128)
    steps = args.steps or (8 if args.tiny else 32)
    prefill_tokens = args.prefill_tokens or (64 if args.tiny else 4096)
    copy_bytes = (args.copy_mib or (64 if args.tiny else 2048)) * 2**20
    batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        ap.error(f"--paths: unknown {unknown}; expected some of {', '.join(PATHS)}")

    cfg = bench_config(args.tiny, args.experts, args.topk, args.vocab)
    torch.manual_seed(0)
    with torch.device(device):
        model = KimiK3ForCausalLM(cfg, dtype=dtype)
    if args.lora_rank:
        model = apply_lora(model, LoRAConfig(rank=args.lora_rank, alpha=2 * args.lora_rank))
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    bandwidth = copy_bandwidth(device, copy_bytes, args.repeats + 1)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
        "model": {"variant": "tiny" if args.tiny else "4layer", "hidden": cfg.hidden_size,
                  "layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "topk": cfg.num_experts_per_token, "vocab": cfg.vocab_size,
                  "params": params, "lora_rank": args.lora_rank},
        "prompt_len": prompt_len, "steps": steps,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "prefill": {"tokens": prefill_tokens,
                    "tokens_per_s": prefill_tokens_per_s(model, prefill_tokens, cfg.vocab_size, device)},
        "limit": {}, "decode": {},
    }
    gen = torch.Generator().manual_seed(1)
    for B in batches:
        weight_bytes = weight_bytes_per_step(model, B, cfg.num_experts_per_token)
        limit_ms = weight_bytes / bandwidth * 1e3
        result["limit"][str(B)] = {"weight_bytes_per_step": weight_bytes, "limit_ms": limit_ms}
        prompts = torch.randint(1, cfg.vocab_size, (B, prompt_len), generator=gen).tolist()
        reference_tokens = None
        for name in paths:
            row = result["decode"].setdefault(name, {})
            try:
                engine = EmbeddedEngine(model, BenchTokenizer(cfg.vocab_size), max_concurrency=B, device=device,
                                        dtype=dtype, decode=PATHS[name])
            except ValueError as e:  # a path that cannot run here: said, not timed
                row[str(B)] = {"skipped": str(e)}
                continue
            ms, tokens = decode_ms_per_step(engine, prompts, steps, args.repeats)
            reference_tokens = reference_tokens or tokens
            same = sum(a == b for x, y in zip(tokens, reference_tokens) for a, b in zip(x, y))
            row[str(B)] = {"ms_per_step": ms, "tokens_per_s": B * 1e3 / ms, "ratio_to_limit": limit_ms / ms,
                           "plan": engine.decode_plan.describe(), "graph_fallback": engine._graph_off,
                           "flashinfer_fallback": engine._flashinfer_off,
                           "small_ops_fallback": engine._small_ops_off,
                           "greedy_tokens_equal_first_path": same / sum(len(x) for x in tokens)}
            if args.profile and B == max(batches):
                row[str(B)]["profile"] = step_profile(engine, prompts, steps)
            engine.release_memory(["kv_cache", "cuda_graph"])
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    lines = [f"embedded decode on {result['device']} ({result['dtype']}, {params / 1e9:.2f} B params, copy "
             f"{bandwidth / 1e9:.0f} GB/s, prefill {result['prefill']['tokens_per_s']:.0f} tok/s)", "",
             "| path | " + " | ".join(f"batch {B}: ms/step (ratio to limit)" for B in batches) + " |",
             "|---|" + "---|" * len(batches)]
    lines.append("| limit | " + " | ".join(f"{result['limit'][str(B)]['limit_ms']:.3f} (1)" for B in batches) + " |")
    for name in paths:
        cells = []
        for B in batches:
            r = result["decode"][name][str(B)]
            cells.append("skipped" if "skipped" in r else f"{r['ms_per_step']:.3f} ({r['ratio_to_limit']:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in paths:
        r = result["decode"][name].get(str(max(batches)), {})
        if "profile" in r:
            lines += profile_table(name, max(batches), r["ms_per_step"], r["profile"])
    return report(result, "\n".join(lines), args.out)


def profile_table(path: str, batch: int, ms_per_step: float, prof: dict) -> list[str]:
    busy = prof["kernel_us_per_step"] / 1e3
    lines = ["", f"{path}, batch {batch}: {ms_per_step:.3f} ms/step, kernels {busy:.3f} ms/step "
             f"({busy / ms_per_step:.0%} of it)", "", "| kernel | calls / step | µs / step | share of the kernels |",
             "|---|---:|---:|---:|"]
    for k in prof["top"]:
        share = k["us"] / prof["kernel_us_per_step"] if prof["kernel_us_per_step"] else float("nan")
        lines.append(f"| `{k['name'][:90]}` | {k['calls']:.1f} | {k['us']:.1f} | {share:.1%} |")
    return lines


if __name__ == "__main__":
    main()
