"""Parallel layout of a K3 run: how the training ranks split into TP × CP × PP × DP (and EP), and how the
colocated rollout engines split the same GPUs.

The rules are the public recipe launcher's (``miles-k3-recipe.md`` §6.1):

- ``full`` trains on exactly 16 nodes × 4 GPUs = 64 ranks. ``TP = 32`` when ``PP = 1`` (64 does not divide the
  96 heads), else ``TP = 64 / (PP · CP)``; ``DP = 64 / (TP · CP · PP)``; ``EP = TP · CP · DP`` (every non-PP rank
  of a stage holds a slice of the 896 experts); ``ETP = 1`` always. The 93 layers split over PP stages as
  ``first = ceil(93 / PP)`` on every stage but the last, which takes ``93 − first · (PP − 1)``.
- ``4layer`` trains on one node × 8 GPUs with ``PP = 1``: TP8 / EP8, rollout engine TP8 / EP8.
- ``tiny`` (ours) is one process, on CPU or one GPU: every size is 1.

The layout itself is ``k3.settings.parallel.ParallelLayout``. Every rejected layout raises :class:`LayoutError`
with a message that names the flag and the values that work.
"""

from __future__ import annotations

import math

from k3.settings.parallel import ParallelLayout

__all__ = [
    "LayoutError",
    "derive_layout",
    "split_pipeline_layers",
    "FULL_NUM_NODES",
    "FULL_GPUS_PER_NODE",
    "FOUR_LAYER_GPUS",
]

FULL_NUM_NODES = 16
FULL_GPUS_PER_NODE = 4
FOUR_LAYER_GPUS = 8
# With PP = 1 the full model cannot use TP = 64 (96 heads): the recipe pins TP to 32 and lets DP take the rest.
FULL_TP_AT_PP1 = 32


class LayoutError(ValueError):
    """A parallelism flag that cannot work for this variant and cluster; the message says what to change."""


def split_pipeline_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: ``ceil(num_layers / pp)`` on each stage, the remainder on the last.

    93 layers: PP 1 → [93], PP 2 → [47, 46], PP 4 → [24, 24, 24, 21], PP 8 → [12] * 7 + [9].
    Raises :class:`LayoutError` when the last stage would be empty (e.g. 93 layers on PP 32: 3 × 31 = 93).
    """
    if pp < 1:
        raise LayoutError(f"--pipeline-parallel-size {pp}: must be >= 1")
    first = math.ceil(num_layers / pp)
    last = num_layers - first * (pp - 1)
    if last < 1:
        raise LayoutError(
            f"--pipeline-parallel-size {pp} cannot split {num_layers} layers: {first} layers on each of the first "
            f"{pp - 1} stages leave {last} for the last one"
        )
    return [first] * (pp - 1) + [last]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_of(values: list[int]) -> str:
    """``[1, 2, 4]`` → ``"1, 2 or 4"`` (the list a message offers the user)."""
    if not values:
        return "none"
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _valid_pipeline_sizes(world: int, num_layers: int) -> list[int]:
    out = []
    for pp in _divisors(world):
        try:
            split_pipeline_layers(num_layers, pp)
        except LayoutError:
            continue
        out.append(pp)
    return out


def _check_positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise LayoutError(f"{flag} {value}: must be >= 1")


def derive_layout(
    model_variant: str,
    *,
    num_nodes: int,
    num_gpus_per_node: int,
    pipeline_parallel_size: int,
    context_parallel_size: int,
    tp_size_override: int | None,
    ep_size_override: int | None,
    rollout_tp_size: int,
    rollout_ep_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_experts: int,
    rollout_defaults: tuple[int, int] = (8, 1),
) -> ParallelLayout:
    """The training/rollout layout of ``model_variant`` on ``num_nodes × num_gpus_per_node`` GPUs.

    ``rollout_defaults`` are the flag defaults of ``--rollout-tp-size`` / ``--rollout-ep-size``; those flags
    apply to ``full`` only, and any other value on another variant is rejected rather than silently ignored.
    """
    for flag, value in [
        ("--num-nodes", num_nodes),
        ("--pipeline-parallel-size", pipeline_parallel_size),
        ("--context-parallel-size", context_parallel_size),
        ("--tp-size-override", tp_size_override),
        ("--ep-size-override", ep_size_override),
        ("--rollout-tp-size", rollout_tp_size),
        ("--rollout-ep-size", rollout_ep_size),
    ]:
        _check_positive(flag, value)
    if num_gpus_per_node < 0:
        raise LayoutError(f"--num-gpus-per-node {num_gpus_per_node}: must be >= 0 (0 = CPU)")
    got = f"got {num_nodes}×{num_gpus_per_node}"

    if model_variant == "full":
        if (num_nodes, num_gpus_per_node) != (FULL_NUM_NODES, FULL_GPUS_PER_NODE):
            raise LayoutError(
                f"--model-variant full requires --num-nodes {FULL_NUM_NODES} --num-gpus-per-node "
                f"{FULL_GPUS_PER_NODE} ({got})"
            )
        world = FULL_NUM_NODES * FULL_GPUS_PER_NODE
        default_tp = FULL_TP_AT_PP1 if pipeline_parallel_size == 1 else None
        _check_rollout_sizes(rollout_tp_size, rollout_ep_size, world, num_attention_heads, num_experts)
        rollout_tp, rollout_ep = rollout_tp_size, rollout_ep_size
    elif model_variant == "4layer":
        if (num_nodes, num_gpus_per_node) != (1, FOUR_LAYER_GPUS):
            raise LayoutError(
                f"--model-variant 4layer requires --num-nodes 1 --num-gpus-per-node {FOUR_LAYER_GPUS} ({got})"
            )
        if pipeline_parallel_size != 1:
            raise LayoutError(
                f"--model-variant 4layer requires --pipeline-parallel-size 1 (got {pipeline_parallel_size}): "
                "its 4 layers run on one stage"
            )
        _reject_full_only_rollout_flags("4layer", rollout_tp_size, rollout_ep_size, rollout_defaults, "TP8/EP8")
        world = FOUR_LAYER_GPUS
        default_tp = None
        rollout_tp, rollout_ep = FOUR_LAYER_GPUS, FOUR_LAYER_GPUS
    elif model_variant == "tiny":
        if num_nodes != 1 or num_gpus_per_node > 1:
            raise LayoutError(
                "--model-variant tiny runs as one process: use --num-nodes 1 and --num-gpus-per-node 0 (CPU) "
                f"or 1 ({got})"
            )
        for flag, value in [
            ("--pipeline-parallel-size", pipeline_parallel_size),
            ("--context-parallel-size", context_parallel_size),
            ("--tp-size-override", tp_size_override),
            ("--ep-size-override", ep_size_override),
        ]:
            if value not in (None, 1):
                raise LayoutError(f"--model-variant tiny runs as one process: {flag} must be 1 (got {value})")
        _reject_full_only_rollout_flags("tiny", rollout_tp_size, rollout_ep_size, rollout_defaults, "TP1/EP1")
        world = 1
        default_tp = None
        rollout_tp, rollout_ep = 1, 1
    else:
        raise LayoutError(f"--model-variant {model_variant!r}: expected tiny, 4layer or full")

    pp, cp = pipeline_parallel_size, context_parallel_size
    if world % pp:
        raise LayoutError(
            f"--pipeline-parallel-size {pp} does not divide {world} GPUs: use "
            f"{_one_of(_valid_pipeline_sizes(world, num_layers))}"
        )
    try:
        pipeline_layers = split_pipeline_layers(num_layers, pp)
    except LayoutError as e:
        raise LayoutError(f"{e}; use {_one_of(_valid_pipeline_sizes(world, num_layers))}") from None

    if (world // pp) % cp:
        raise LayoutError(
            f"--context-parallel-size {cp} does not fit {world} GPUs with --pipeline-parallel-size {pp} "
            f"(PP × CP must divide {world}): use {_one_of(_divisors(world // pp))}"
        )

    if tp_size_override is not None:
        tp = tp_size_override
        room = world // (pp * cp)
        if room % tp or num_attention_heads % tp:
            fits = [t for t in _divisors(room) if num_attention_heads % t == 0]
            raise LayoutError(
                f"--tp-size-override {tp} must divide the {num_attention_heads} attention heads and the {room} "
                f"ranks left by PP {pp} × CP {cp} on {world} GPUs: use {_one_of(fits)}"
            )
    elif default_tp is not None:
        tp = default_tp
        if world % (tp * cp * pp):
            fits = [c for c in _divisors(world // pp) if (world // pp) % (tp * c) == 0]
            raise LayoutError(
                f"--context-parallel-size {cp} with --pipeline-parallel-size {pp} needs TP {tp} × CP {cp} × PP {pp}"
                f" = {tp * cp * pp} GPUs, more than {world}: use --context-parallel-size {_one_of(fits)} "
                "(or set --tp-size-override)"
            )
    else:
        tp = world // (pp * cp)
        if num_attention_heads % tp:
            raise LayoutError(
                f"TP {tp} (= {world} GPUs / (PP {pp} × CP {cp})) does not divide the {num_attention_heads} "
                "attention heads: raise --pipeline-parallel-size or --context-parallel-size, or set "
                "--tp-size-override"
            )
    dp = world // (tp * cp * pp)

    stage_ranks = world // pp  # every non-PP rank of a stage: TP × CP × DP
    if ep_size_override is not None:
        ep = ep_size_override
        if stage_ranks % ep or num_experts % ep:
            fits = [e for e in _divisors(stage_ranks) if num_experts % e == 0]
            raise LayoutError(
                f"--ep-size-override {ep} must divide the {num_experts} experts and the {stage_ranks} ranks of a "
                f"pipeline stage ({world} GPUs / PP {pp}): use {_one_of(fits)}"
            )
    else:
        ep = tp * cp * dp
        if num_experts % ep:
            raise LayoutError(
                f"EP {ep} (= TP {tp} × CP {cp} × DP {dp}) does not divide the {num_experts} experts: set "
                f"--ep-size-override to one of {_one_of([e for e in _divisors(stage_ranks) if num_experts % e == 0])}"
            )

    uneven = len(set(pipeline_layers)) > 1
    gpus = num_nodes * num_gpus_per_node
    return ParallelLayout(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        data_parallel_size=dp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        # Megatron turns sequence parallelism off by itself at TP 1; say so in the resolved config.
        sequence_parallel=tp > 1,
        num_layers=num_layers,
        pipeline_layers=tuple(pipeline_layers),
        decoder_first_pipeline_num_layers=pipeline_layers[0] if uneven else None,
        decoder_last_pipeline_num_layers=pipeline_layers[-1] if uneven else None,
        rollout_tp_size=rollout_tp,
        rollout_ep_size=rollout_ep,
        num_rollout_engines=max(gpus, 1) // rollout_tp,
    )


def _check_rollout_sizes(tp: int, ep: int, world: int, num_heads: int, num_experts: int) -> None:
    if world % tp or num_heads % tp:
        fits = [t for t in _divisors(math.gcd(world, num_heads))]
        raise LayoutError(
            f"--rollout-tp-size {tp} must divide {world} (GPUs) and {num_heads} (attention heads): use {_one_of(fits)}"
        )
    if tp % ep or num_experts % ep:
        fits = [e for e in _divisors(tp) if num_experts % e == 0]
        raise LayoutError(
            f"--rollout-ep-size {ep} must divide --rollout-tp-size {tp} and the {num_experts} experts: use "
            f"{_one_of(fits)}"
        )


def _reject_full_only_rollout_flags(
    variant_name: str, tp: int, ep: int, defaults: tuple[int, int], fixed: str
) -> None:
    for flag, value, default in [("--rollout-tp-size", tp, defaults[0]), ("--rollout-ep-size", ep, defaults[1])]:
        if value != default:
            raise LayoutError(
                f"{flag} applies to --model-variant full only; {variant_name} rollout engines are {fixed} "
                f"(drop {flag} {value})"
            )
