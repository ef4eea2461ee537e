"""Packed sequences (THD) on the megatron backend, CPU (gloo, tests/megatron_compat.py): packed == padded for each
sequence — forward log-probs, the loss and every LoRA gradient over 3 Adam steps, the final adapters — at TP1 and
under TP2, CP2, PP2 (variable micro-batch lengths between stages) and DP2 × EP2 (each data-parallel rank packs other
sequences, so the expert all-to-all moves unequal token counts), and with recompute: CP2, TP2 and PP2 full, DP2 × EP2
selective.

The loss is the recipe's (``k3.megatron.packing.sample_mean_weights``): each sequence's masked token mean, averaged
over the 6 sequences; it is the same function of the sequences however they are packed, so both forms minimise the
same objective. Baseline: TP1 on padded rows ``[3, 16]`` (two micro-batches). Packed: the same two groups of three
sequences, each group one row laid out by ``k3.megatron.packing.packed_bounds`` (per-sequence padding under CP).

Two worker runs (this file as a script): one process (the baseline, TP1 packed, the same rows without their
bounds as the control, the parts that need no bounds — latent MoE and AttnRes mix — on a packed stream vs each
sequence alone, and the input errors), one 2-rank torchrun (the layouts). The GPU form (one H200: fla's varlen
KDA and torch's FlashAttention varlen MLA in BF16) is marked ``gpu``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from layout_parity import assert_adapters_equal, rel

LENGTHS = (7, 12, 5, 16, 9, 11)
PROMPTS = (3, 4, 2, 6, 3, 5)  # the loss counts the tokens after the prompt
GROUPS = ((0, 1, 2), (3, 4, 5))  # the two micro-batches
STEPS = 3
RANK, ALPHA = 4, 8.0
# Packed and padded rows run the same math in another order (the KDA chunks of a padded row span its padding, a
# packed sequence's end where it ends), so step 1 agrees to float32 rounding; Adam's normalisation then lets
# the ~1e-6 differences of near-zero gradient entries grow, as between layouts (layout_parity.GRAD_TOLS).
# Measured (float32, CPU): step-1 gradients within 2.5e-4 relative (the worst, a small-norm MLA q_a factor at TP2),
# step 3 within 9e-3; the bounds leave a factor of 2. A sequence that sees another is off by O(1).
LOSS_REL = 1e-5
GRAD_TOLS = (5e-4, 5e-3, 2e-2)
# The wide slice in BF16, packed vs each sequence alone on the routing each chose alone (RoutingReplay). Measured on
# CPU (the torch forms, two runs): logits 2.2e-2, gradients 3.3–3.6e-2 relative; routed freshly, 5.5–12.5% of the
# token choices flipped an expert and the logits were 0.24–0.26 off. A sequence that sees another is off by O(1).
BF16_LOGITS_REL, BF16_GRAD_REL = 5e-2, 1e-1
# name -> (tp, ep, pp, cp, recompute); on 2 ranks (ep2 is DP2 x EP2). Recompute: megatron's full (uniform, 1 layer,
# the recipe's) or selective with every module K3 recomputes (the MoE's all-to-all recomputed in the backward)
LAYOUTS = {"tp2": (2, 1, 1, 1, None), "cp2": (1, 1, 1, 2, None), "pp2": (1, 1, 2, 1, None),
           "ep2": (1, 2, 1, 1, None), "cp2_recompute": (1, 1, 1, 2, "full"), "tp2_recompute": (2, 1, 1, 1, "full"),
           "pp2_recompute": (1, 1, 2, 1, "full"), "ep2_selective": (1, 2, 1, 1, "selective_all")}


# ---------------------------------------------------------------------------------------------- the data
def _sequences(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def _labels_and_mask(seq: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels (0 after the last token) and the loss mask of the tokens after the prompt."""
    labels = torch.cat([seq[1:], torch.zeros(1, dtype=torch.long)])
    mask = torch.zeros(len(seq))
    mask[prompt - 1:len(seq) - 1] = 1.0
    return labels, mask


def padded_batches(seqs: list[torch.Tensor]) -> list:
    """Baseline micro-batches: each group as right-padded rows ``[3, 16]``, with the recipe's loss weights."""
    from k3.megatron.packing import sample_mean_weights
    from k3.megatron.training import MicroBatch

    width = max(LENGTHS)
    out = []
    for group in GROUPS:
        ids = torch.zeros(len(group), width, dtype=torch.long)
        labels, mask, weights = torch.zeros_like(ids), torch.zeros(len(group), width), torch.zeros(len(group), width)
        for r, i in enumerate(group):
            n = LENGTHS[i]
            ids[r, :n] = seqs[i]
            labels[r, :n], mask[r, :n] = _labels_and_mask(seqs[i], PROMPTS[i])
            weights[r] = sample_mean_weights(mask[r], torch.tensor([0, width]), len(LENGTHS))
        out.append(MicroBatch(ids, labels, mask, {"weights": weights}))
    return out


def packed_batches(seqs: list[torch.Tensor], tp: int, cp: int, halo: int) -> tuple[list, list[list[int]]]:
    """Each group as one packed row (``packed_bounds``) and the start of each sequence in it."""
    from k3.megatron.packing import packed_bounds, sample_mean_weights
    from k3.megatron.training import MicroBatch

    out, starts = [], []
    for group in GROUPS:
        cu = packed_bounds([LENGTHS[i] for i in group], tp, cp, halo)
        T = int(cu[-1])
        ids, labels, mask = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T)
        for j, i in enumerate(group):
            a, n = int(cu[j]), LENGTHS[i]
            ids[0, a:a + n] = seqs[i]
            labels[0, a:a + n], mask[0, a:a + n] = _labels_and_mask(seqs[i], PROMPTS[i])
        weights = sample_mean_weights(mask, cu, len(LENGTHS))
        out.append(MicroBatch(ids, labels, mask, {"weights": weights}, cu_seqlens=cu))
        starts.append(cu[:len(group)].tolist())
    return out, starts


def weighted_nll(mb, out, ctx):
    """The recipe's loss on these batches: ``Σ w · (−log p)`` (weights from ``sample_mean_weights``)."""
    return (-out.log_probs * mb.extra["weights"]).sum(), {}


# ---------------------------------------------------------------------------------------------- the workers
def _run(tp: int, ep: int, pp: int, cp: int, packed: bool, granularity: str | None, cfg, ref, seqs) -> dict:
    """One layout's per-sequence forward log-probs and, per Adam step, the loss and every adapter gradient (merged
    over stages), and the final adapters."""
    from megatron.core import parallel_state
    from test_megatron_parallel import _all_stages, _with_random_B

    from k3.lora import LoRAConfig
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.lora import gather_lora, load_lora
    from k3.megatron.parallel import init_parallel
    from k3.megatron.recompute import K3_SELECTIVE_MODULES, Recompute
    from k3.megatron.training import build_lora_trainer

    sizes = ParallelLayout.model_parallel(tp=tp, ep=ep, pp=pp, cp=cp, first_stage_layers=4 if pp > 1 else None)
    init_parallel(sizes)
    recompute = {None: Recompute(), "full": Recompute("full", "uniform", 1),
                 "selective_all": Recompute("selective", modules=K3_SELECTIVE_MODULES)}[granularity]
    config = k3_transformer_config(cfg, sizes, perform_initialization=False, recompute=recompute)
    base = {k: v.clone() for k, v in ref.state_dict().items()}
    trainer = build_lora_trainer(config, LoRAConfig(rank=RANK, alpha=ALPHA),
                                 lambda m: load_hf_state_dict(m, base, cfg), lr=2e-4, clip_grad=0.0)
    model = trainer.model[0].module
    load_lora(model, _with_random_B(_all_stages(gather_lora(model))))
    if packed:
        batches, starts = packed_batches(seqs, tp, cp, cfg.linear_attn_config.short_conv_kernel_size - 1)
    else:
        batches, starts = padded_batches(seqs), [[0] * len(g) for g in GROUPS]
    out: dict = {"log_probs": {}, "loss": [], "grads": []}
    for mb, lp, group, first in zip(batches, trainer.forward(batches), GROUPS, starts):
        for r, (i, a) in enumerate(zip(group, first)):
            row = lp.log_probs[0 if packed else r]
            out["log_probs"][i] = row[a:a + LENGTHS[i] - 1].clone()
    if packed and tp == cp == pp == 1:  # the control: the same rows without their bounds
        from k3.megatron.training import MicroBatch

        out["unbounded"] = {}
        for mb, group, first in zip(batches, GROUPS, starts):
            row = trainer.forward([MicroBatch(mb.input_ids, mb.labels, mb.loss_mask)])[0].log_probs[0]
            for i, a in zip(group, first):
                out["unbounded"][i] = row[a:a + LENGTHS[i] - 1].clone()
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    for _ in range(STEPS):
        out["loss"].append(trainer.step(batches[dp_rank::dp], weighted_nll)["loss"])
        out["grads"].append(_all_stages(gather_lora(model, grads=True)))
    out["final"] = _all_stages(gather_lora(model))
    parallel_state.destroy_model_parallel()
    return out


def _per_token_parts(cfg, ref) -> dict:
    """The parts of K3 that need no bounds: the latent MoE (router, dispatcher, experts, shared experts) and the
    AttnRes mix over a packed stream equal the same parts on each sequence alone; and no rotary positions exist."""
    from megatron.core import parallel_state

    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.model import k3_model_provider
    from k3.megatron.moe import K3LatentMoE
    from k3.megatron.parallel import init_parallel
    from k3.model.attn_res import attn_res_mix

    init_parallel(ParallelLayout.model_parallel())
    model = k3_model_provider(k3_transformer_config(cfg, perform_initialization=False))
    load_hf_state_dict(model, ref.state_dict(), cfg)
    layer = next(m for m in model.decoder.layers if isinstance(m.mlp, K3LatentMoE))
    gen = torch.Generator().manual_seed(5)
    bounds = [0, 7, 19, 24]
    x = torch.randn(24, 1, cfg.hidden_size, generator=gen)
    rows = [torch.randn(24, 1, cfg.hidden_size, generator=gen) for _ in range(3)]
    with torch.no_grad():
        layer.mlp_res_proj.weight.normal_(0.0, 0.5, generator=gen)
        moe = layer.mlp(x)
        mix = attn_res_mix(rows, layer.mlp_res_norm, layer.mlp_res_proj)
        moe_err = mix_err = 0.0
        for a, b in zip(bounds[:-1], bounds[1:]):
            moe_err = max(moe_err, (moe[a:b] - layer.mlp(x[a:b])).abs().max().item())
            alone = attn_res_mix([r[a:b] for r in rows], layer.mlp_res_norm, layer.mlp_res_proj)
            mix_err = max(mix_err, (mix[a:b] - alone).abs().max().item())
    out = {"moe_err": moe_err, "moe_scale": moe.abs().max().item(), "mix_err": mix_err,
           "position_embedding_type": model.position_embedding_type,
           "rotary_modules": [n for n, _ in model.named_modules() if "rotary" in n.lower()]}
    parallel_state.destroy_model_parallel()
    return out


def _routing_replay_check(cfg, ref) -> dict:
    """:class:`RoutingReplay` (megatron's routing replay through ``K3Router``) on CPU: the packed stream routed on
    the experts its sequences chose alone equals them, as it does routed freshly (no token flips here), and the
    replayed experts are the ones used (every target moved by one expert moves the output)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.model import k3_model_provider
    from k3.megatron.packed import packed_seq_params
    from k3.megatron.parallel import init_parallel
    from k3.settings.parallel import ParallelLayout

    init_parallel(ParallelLayout.model_parallel())
    model = k3_model_provider(k3_transformer_config(cfg, perform_initialization=False,
                                                    moe_enable_routing_replay=True))
    load_hf_state_dict(model, ref.state_dict(), cfg)
    model.eval()
    seqs = _sequences(cfg.vocab_size)[:3]
    cu = [0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]
    routing, stream = RoutingReplay(model), torch.cat(seqs)[None]

    def packed():
        return model(stream, None, None, packed_seq_params=packed_seq_params(cu, "cpu"))[0]

    with torch.no_grad():
        alone = torch.cat(routing.record(lambda seq: model(seq[None], None, None)[0], seqs))
        fresh, flipped = routing.fresh(packed)
        replayed = routing.replay(packed)
        routing.targets = [(t + 1) % cfg.num_experts for t in routing.targets]
        moved = routing.replay(packed)
    out = {"layers": len(routing.replays), "tokens": [len(t) for t in routing.targets], "flipped": flipped,
           "fresh_err": rel(fresh, alone), "replayed_err": rel(replayed, alone), "moved": rel(moved, alone)}
    RouterReplay.clear_global_router_replay_instances()
    parallel_state.destroy_model_parallel()
    return out


def _input_errors(cfg) -> dict[str, str]:
    """What the layers and the trainer say to inputs they cannot take (type and message of each)."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from k3.megatron.config import k3_transformer_config

    from k3.settings.parallel import ParallelLayout
    from k3.megatron.model import k3_model_provider
    from k3.megatron.packed import packed_seq_params
    from k3.megatron.parallel import init_parallel
    from k3.megatron.training import MicroBatch, _check_shapes

    init_parallel(ParallelLayout.model_parallel())
    model = k3_model_provider(k3_transformer_config(cfg))
    layer, hidden, ids = model.decoder.layers[0], torch.zeros(6, 1, cfg.hidden_size), torch.zeros(1, 6, dtype=torch.long)
    calls = {
        "attention_mask": lambda: layer(hidden, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool)),
        "inference_context": lambda: layer(hidden, inference_context=object()),
        "sbhd": lambda: model(ids, None, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd")),
        "short_bounds": lambda: model(ids, None, None, packed_seq_params=packed_seq_params([0, 2, 5], "cpu")),
        "packed_rows": lambda: MicroBatch(torch.zeros(2, 6, dtype=torch.long), ids, ids.float(),
                                          cu_seqlens=torch.tensor([0, 6])),
        "mixed": lambda: _check_shapes([MicroBatch(ids, ids, ids.float(), cu_seqlens=torch.tensor([0, 6])),
                                        MicroBatch(ids, ids, ids.float())], "step"),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test compares type and message
            errors[name] = f"{type(e).__name__}: {e}"
    parallel_state.destroy_model_parallel()
    return errors


def _worker(mode: str, out_path: str) -> None:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist
    from test_megatron_parallel import _reference_and_data

    cfg, ref, _ = _reference_and_data()
    seqs = _sequences(cfg.vocab_size)
    if mode == "one":
        results = {"errors": _input_errors(cfg), "per_token": _per_token_parts(cfg, ref),
                   "routing_replay": _routing_replay_check(cfg, ref),
                   "padded": _run(1, 1, 1, 1, False, None, cfg, ref, seqs),
                   "packed": _run(1, 1, 1, 1, True, None, cfg, ref, seqs)}
    else:
        results = {name: _run(tp, ep, pp, cp, True, g, cfg, ref, seqs) for name, (tp, ep, pp, cp, g) in LAYOUTS.items()}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


# ---------------------------------------------------------------------------------------------- routing replay
class RoutingReplay:
    """megatron's routing replay on every ``K3Router`` of a model built with ``moe_enable_routing_replay``: the
    top-k experts each token chose when its sequence ran alone, replayed on the packed stream.

    At GPU precision the same token does not round the same way in another batch (the grouped expert GEMM at other
    group sizes: one BF16 ulp, 4e-3 relative, measured on the H100), and by the second MoE layer such differences
    flip top-4 choices whose scores nearly tie; a flipped token's output moves by O(1). The routing is a function
    of each token alone (checked exactly on CPU), so pinning it compares what packing can change."""

    def __init__(self, model) -> None:
        from k3.megatron.moe import K3Router

        self.replays = [m.router_replay for m in model.modules() if isinstance(m, K3Router)]
        if not self.replays or any(r is None for r in self.replays):
            raise ValueError("RoutingReplay: build the model with moe_enable_routing_replay=True")

    def _act(self, action) -> None:
        for r in self.replays:
            r.clear_indices()
            r.set_router_replay_action(action)

    def record(self, forward, seqs: list) -> list:
        """``forward(seq)`` for each sequence; keeps every layer's top-k indices over the sequences in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        outs, chosen = [], [[] for _ in self.replays]
        for seq in seqs:
            self._act(RouterReplayAction.RECORD)
            outs.append(forward(seq))
            for layer, r in zip(chosen, self.replays):
                layer.append(r.get_recorded_indices())
        self.targets = [torch.cat(layer) for layer in chosen]
        self._act(None)
        return outs

    def fresh(self, forward):
        """``forward()`` routed freshly, and the share of its tokens (over every MoE layer) whose expert set is not
        the recorded one."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._act(RouterReplayAction.RECORD)
        out = forward()
        flipped = [(r.get_recorded_indices().sort(1).values != t.sort(1).values).any(1)
                   for r, t in zip(self.replays, self.targets)]
        self._act(None)
        return out, torch.cat(flipped).float().mean().item()

    def replay(self, forward):
        """``forward()`` on the recorded experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._act(RouterReplayAction.REPLAY_FORWARD)
        for r, t in zip(self.replays, self.targets):
            r.set_target_indices(t)
        out = forward()
        self._act(None)
        return out


# ---------------------------------------------------------------------------------------------- the GPU worker
def _packed_vs_alone(cfg, seqs: list[torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    """One dtype, each sequence alone vs the packed stream on the routing the sequences chose alone
    (:class:`RoutingReplay`): the relative error of the logits (the worst sequence), of every LoRA gradient of the
    recipe's loss (the worst), and, routed freshly, the share of tokens whose experts change and the logits' error."""
    import torch.nn.functional as F
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from test_megatron_gpu import _megatron, _reference

    from k3.lora import LoRAConfig
    from k3.megatron.lora import apply_megatron_lora
    from k3.megatron.packed import packed_seq_params
    from k3.megatron.packing import packed_bounds, sample_mean_weights

    lengths = [len(s) for s in seqs]
    cu = packed_bounds(lengths)
    model = _megatron(cfg, _reference(cfg, dtype), dtype, moe_enable_routing_replay=True)
    apply_megatron_lora(model, LoRAConfig(rank=8, alpha=16), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.02)
    routing = RoutingReplay(model)
    stream = torch.cat(seqs)[None]

    def packed_logits():
        return model(stream, None, None, packed_seq_params=packed_seq_params(cu, "cuda"))[0].float()

    def alone_logits(seq):
        return model(seq[None], None, None)[0].float()

    def worst(packed):
        return max(((packed[a:b] - x).norm() / x.norm()).item()
                   for a, b, x in zip(cu[:-1].tolist(), cu[1:].tolist(), alone))

    model.eval()
    with torch.no_grad():
        alone = routing.record(alone_logits, seqs)
        fresh, flipped = routing.fresh(packed_logits)
        out = {"logits_rel": worst(routing.replay(packed_logits)), "fresh_logits_rel": worst(fresh),
               "fresh_tokens_flipped": flipped}
    model.train()
    targets = [torch.roll(s, -1) for s in seqs]
    masks = [torch.ones(n, device="cuda") for n in lengths]
    for m in masks:
        m[-1] = 0.0

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}

    alone_loss = sum((F.cross_entropy(logits, t, reduction="none") * m).sum() / m.sum() / len(seqs)
                     for logits, t, m in zip(routing.record(alone_logits, seqs), targets, masks))
    nll = F.cross_entropy(routing.replay(packed_logits), torch.cat(targets), reduction="none")
    g_packed = grads((nll * sample_mean_weights(torch.cat(masks), cu, len(seqs))).sum())
    g_alone = grads(alone_loss)
    out["grad_rel"] = max(((g_packed[k] - g_alone[k]).norm() / g_alone[k].norm()).item() for k in g_alone)
    out["grad_count"] = len(g_alone)
    RouterReplay.clear_global_router_replay_instances()  # megatron keeps every instance in a class-level list
    return out


def _wide_inputs() -> tuple:
    """The GPU check's model config (a wide K3 slice: real KDA / MLA head dims) and its five sequences (on CUDA,
    or wherever the megatron shim puts ``.cuda()``), after ``init_parallel`` at TP1."""
    from test_megatron_gpu import _wide_config

    from k3.megatron.parallel import init_parallel
    from k3.settings.parallel import ParallelLayout

    init_parallel(ParallelLayout.model_parallel())
    cfg = _wide_config()
    gen = torch.Generator().manual_seed(3)
    return cfg, [torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda() for n in (200, 37, 513, 64, 130)]


def _gpu_check() -> dict:
    """One GPU, no CPU shim: the wide slice in BF16 and float32, packed vs each sequence alone (fla's varlen
    chunk_kda, torch's varlen FlashAttention): the logits, and every LoRA gradient of the recipe's loss. Each
    pass's results go to stderr as it ends."""
    from k3.kernels.kda.fla import fla_available
    from k3.megatron.packed import _varlen_attn, _varlen_usable

    cfg, seqs = _wide_inputs()
    out = {"fla": fla_available()}
    q = torch.zeros(1, 4, 8, 192, device="cuda", dtype=torch.bfloat16)
    out["varlen"] = _varlen_usable(q, q[..., :128])
    out["varlen_api"] = _varlen_attn() is not None
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out.update({f"{name}_{k}": v for k, v in _packed_vs_alone(cfg, seqs, dtype).items()})
        print(json.dumps({"pass": name, **out}), file=sys.stderr, flush=True)  # kept if the next pass runs over
    return out


def _bf16_on_cpu() -> dict:
    """The GPU check's BF16 pass at its shape on CPU (the megatron shim, the torch KDA and attention forms)."""
    import megatron_compat

    megatron_compat.install()
    cfg, seqs = _wide_inputs()
    return _packed_vs_alone(cfg, seqs, torch.bfloat16)


if __name__ == "__main__":
    if sys.argv[1] in ("gpu", "bf16_on_cpu"):
        print(json.dumps(_gpu_check() if sys.argv[1] == "gpu" else _bf16_on_cpu()))
    else:
        _worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megatron_compat import run_workers

    tmp = tmp_path_factory.mktemp("megatron_packed")
    run_workers([__file__, "one", str(tmp / "one.pt")], nproc=1)
    run_workers([__file__, "layouts", str(tmp / "layouts.pt")], nproc=2, timeout=480.0)
    return {**torch.load(tmp / "one.pt"), **torch.load(tmp / "layouts.pt")}


def assert_losses_equal(got: list[float], base: list[float]) -> None:
    """Every step's loss within ``LOSS_REL`` of the baseline's, and the baseline learns."""
    assert len(got) == len(base) == STEPS and base[-1] < base[0]
    for a, b in zip(got, base):
        assert a == pytest.approx(b, rel=LOSS_REL)


def assert_gradients_equal(got: list[dict], base: list[dict]) -> None:
    """Per step the same LoRA gradient names, each non-zero in the baseline and within that step's ``GRAD_TOLS``."""
    for step, tol in enumerate(GRAD_TOLS):
        assert sorted(got[step]) == sorted(base[step])
        for name in base[step]:
            assert base[step][name].norm() > 0, name
            assert rel(got[step][name], base[step][name]) < tol, (step, name, rel(got[step][name], base[step][name]))


def _check_log_probs(got: dict, base: dict, atol: float) -> None:
    assert sorted(got) == sorted(base) == list(range(len(LENGTHS)))
    for i in base:
        assert got[i].shape == base[i].shape == (LENGTHS[i] - 1,)
        torch.testing.assert_close(got[i], base[i], rtol=0, atol=atol)


def test_tp1_packed_log_probs_equal_padded(results):
    _check_log_probs(results["packed"]["log_probs"], results["padded"]["log_probs"], 2e-5)


def test_tp1_packed_training_equals_padded(results):
    got, base = results["packed"], results["padded"]
    assert_losses_equal(got["loss"], base["loss"])
    assert_gradients_equal(got["grads"], base["grads"])
    assert_adapters_equal(got["final"], base["final"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_packed_log_probs_equal_padded(results, layout):
    _check_log_probs(results[layout]["log_probs"], results["padded"]["log_probs"], 3e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_packed_losses_equal_padded(results, layout):
    assert_losses_equal(results[layout]["loss"], results["padded"]["loss"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_packed_lora_gradients_equal_padded(results, layout):
    assert_gradients_equal(results[layout]["grads"], results["padded"]["grads"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_packed_final_adapters_equal_padded(results, layout):
    assert_adapters_equal(results[layout]["final"], results["padded"]["final"])


def test_the_same_rows_without_bounds_mix_the_sequences(results):
    # the control: without cu_seqlens the first sequence of each row is unchanged, every later one moves
    base, unbounded = results["padded"]["log_probs"], results["packed"]["unbounded"]
    for group in GROUPS:
        torch.testing.assert_close(unbounded[group[0]], base[group[0]], rtol=0, atol=2e-5)
        assert min(rel(unbounded[i], base[i]) for i in group[1:]) > 1e-3


def test_moe_and_attn_res_work_per_token_and_no_rotary_positions_exist(results):
    r = results["per_token"]
    assert r["moe_scale"] > 1e-3 and r["moe_err"] < 1e-6 and r["mix_err"] < 1e-6, r
    assert r["position_embedding_type"] == "none" and r["rotary_modules"] == []


def test_routing_replay_routes_the_packed_stream_on_the_recorded_experts(results):
    r = results["routing_replay"]
    assert r["layers"] > 0 and r["tokens"] == [sum(LENGTHS[:3])] * r["layers"] and r["flipped"] == 0.0, r
    assert r["fresh_err"] < 1e-5 and r["replayed_err"] < 1e-5, r
    assert r["moved"] > 1e-2, r  # the replayed experts are the ones that compute


@pytest.mark.parametrize("name, match", [
    ("attention_mask", "ValueError: K3 megatron layers take no attention_mask: .* packed sequences carry their "
                       r"boundaries in packed_seq_params \(cu_seqlens\)"),
    ("inference_context", "ValueError: K3 megatron layers take no inference_context"),
    ("sbhd", "ValueError: packed_seq_params.qkv_format='sbhd': K3 packs sequences as 'thd'"),
    ("short_bounds", "ValueError: .*cu_seqlens .*from 0 to the 6 tokens"),
    ("packed_rows", r"ValueError: MicroBatch: packed sequences \(cu_seqlens\) come as one row \[1, T\]"),
    ("mixed", "ValueError: step: some micro-batches are packed"),
])
def test_bad_inputs_are_input_errors(results, name, match):
    import re

    assert re.search(match, results["errors"][name]), results["errors"][name]


@pytest.mark.slow
def test_bf16_packed_equals_each_sequence_alone_on_the_replayed_routing():
    from megatron_compat import run_workers

    proc = run_workers([__file__, "bf16_on_cpu"], nproc=1, timeout=400)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["grad_count"] > 0 and 0.0 <= r["fresh_tokens_flipped"] < 1.0, r
    assert r["logits_rel"] < BF16_LOGITS_REL and r["grad_rel"] < BF16_GRAD_REL, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_equals_each_sequence_alone_on_gpu():
    from megatron_compat import run_workers  # only its launcher: the GPU worker does not install the patches

    # under pytest's 600 s: the launcher, not pytest-timeout, kills a worker that runs over, and reports its output
    proc = run_workers([__file__, "gpu"], nproc=1, timeout=540)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)  # the measured errors, in pytest's -rA report
    # the CUDA paths under test: fla's cu_seqlens KDA and, where this torch has it, FlashAttention varlen (else the
    # per-sequence SDPA, which the CPU tests cover)
    assert r["fla"] and r["varlen"] == r["varlen_api"], r
    # on the routing each sequence chose alone (RoutingReplay; routed freshly, the tokens whose experts flip are
    # reported, not bounded)
    assert r["fp32_logits_rel"] < 5e-3, r  # fla's float32 kernels use TF32 dot products
    assert r["bf16_logits_rel"] < BF16_LOGITS_REL, r
    assert r["fp32_grad_rel"] < 2e-2, r
    assert r["bf16_grad_rel"] < BF16_GRAD_REL, r
    assert r["bf16_grad_count"] == r["fp32_grad_count"] > 0, r
