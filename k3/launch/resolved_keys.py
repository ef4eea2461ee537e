"""The registry of resolved-config keys: for every name ``resolved_config.json`` / ``.txt`` prints, the code that
applies its value, or why it is printed although nothing reads it.

``resolved_config.txt`` is the user's proof of what ran, so a printed key must be a key in effect. Each entry of
:data:`REGISTRY` is one of:

- **applied**: ``readers`` name the modules that apply the value and the attribute (``.name``) or keyword
  (``name=``) each reads it by, the settings reader first (usually ``k3/rl/loop.py``, which hands each part its
  settings) and the code where it takes effect after it;
- **derived**: a flag the launcher turns into other printed keys (``becomes``), e.g. ``--mode`` fills the batch
  sizes; its reader is the launcher module that does so;
- **informational**: nothing reads the value, and ``informational`` says why it is printed; a value the code fixes
  (the loss has no KL term, so ``kl_loss_coef`` is 0.0) is ``pinned``, so the printed value can never drift from
  the code.

An entry with ``only_with`` (``("backend", "megatron")``) is applied only when that key has that value; otherwise
the dump prints ``off`` in its place (``resolved_value``), because the part that would apply it is not running,
and ``k3 train`` refuses the flag when it was given (``k3.launch.preflight``).

:data:`NOT_PRINTED` lists the settings fields the dump leaves out because nothing applies them, each with its
reason. ``tests/unit/test_resolved_key_registry.py`` holds the registry to the code: a printed key missing here,
a reader that does not read its key, a settings field read by code but not printed all fail it.
``docs/RESOLVED_KEYS.md`` is generated from this table (:func:`registry_markdown`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Reader", "ResolvedKey", "REGISTRY", "NOT_PRINTED", "FIELD_SOURCES", "condition_holds",
           "resolved_value", "registry_markdown"]

LOOP = "k3/rl/loop.py"
WORKER = "k3/rl/trainer_worker.py"
MEGATRON_POLICY = "k3/rl/trainers/megatron.py"
SERVER_ARGS = "k3/rollout/sglang/server_args.py"
ARGS = "k3/launch/args.py"


@dataclass(frozen=True)
class Reader:
    """One module that reads a key's value: ``module`` (a path under the repository root) reads it as the attribute
    ``.name`` or the keyword ``name=`` (``name``: the key itself unless the settings hold it under another)."""

    module: str
    name: str


@dataclass(frozen=True)
class ResolvedKey:
    """One printed key; see the module docstring for the three kinds. ``does``: what the value does, one line."""

    name: str
    does: str
    readers: tuple[Reader, ...] = ()
    becomes: tuple[str, ...] = ()
    informational: str | None = None
    pinned: Any = None  # a constant, or a function of the printed mapping giving the only value it may print
    only_with: tuple[str, Any] | None = None
    off: Any = None

    @property
    def kind(self) -> str:
        return "informational" if self.informational else "derived" if self.becomes else "applied"


def _applied(name: str, does: str, *readers: tuple[str, str] | str, only_with: tuple[str, Any] | None = None,
             off: Any = None, becomes: tuple[str, ...] = ()) -> ResolvedKey:
    """An applied (or, with ``becomes``, derived) key; a reader given as a bare module reads the key's own name."""
    rs = tuple(Reader(r, name) if isinstance(r, str) else Reader(*r) for r in readers)
    return ResolvedKey(name, does, rs, becomes=becomes, only_with=only_with, off=off)


def _derived(name: str, does: str, becomes: tuple[str, ...], *readers: tuple[str, str] | str,
             only_with: tuple[str, Any] | None = None) -> ResolvedKey:
    return _applied(name, does, *(readers or (ARGS,)), becomes=becomes, only_with=only_with)


def _info(name: str, does: str, why: str, pinned: Any = None) -> ResolvedKey:
    return ResolvedKey(name, does, informational=why, pinned=pinned)


MEGATRON = ("backend", "megatron")
ADAM = ("optimizer", "adam")
SGD = ("optimizer", "sgd")
SGLANG = ("rollout_engine", "sglang")
_LAYOUT = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
           "data_parallel_size", "expert_model_parallel_size", "num_layers", "pipeline_layers",
           "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "rollout_tp_size",
           "rollout_ep_size", "num_rollout_engines")

_ENTRIES: tuple[ResolvedKey, ...] = (
    # ------------------------------------------------------------------ run
    _derived("mode", "debug_minimal or normal: the sizes, learning rate and optimizer settings it fills in",
             ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "global_batch_size",
              "rollout_max_response_len", "reward_model", "lr", "optimizer", "weight_decay", "sglang_context_length")),
    _applied("run_id", "names the run: its status events, the W&B group and the Ray placement group",
             LOOP, "k3/launch/placement.py"),
    _applied("run_dir", "where the run writes metrics.jsonl, resolved_config.* and adapters/", LOOP),
    _applied("resume", "continue the run in run_dir from its latest adapter checkpoint", LOOP),
    _applied("seed", "seed of data order, sampling, LoRA init and the engine", LOOP, SERVER_ARGS),
    _applied("dry_run", "resolve and check everything, write nothing, start nothing", "k3/launch/train.py"),
    _derived("output_dir", "where CUDA core dumps go (CUDA_COREDUMP_FILE in every worker's env)", ("env",),
             only_with=("cuda_core_dump", True)),
    _derived("cuda_core_dump", "a CUDA core dump on a kernel fault (CUDA_ENABLE_COREDUMP_ON_EXCEPTION)", ("env",)),
    # ------------------------------------------------------------------ model
    _derived("model_variant", "tiny, 4layer or full: the parallel layout, device count and per-GPU token budget",
             _LAYOUT + ("num_gpus_per_node", "max_tokens_per_gpu", "hf_checkpoint", "ref_load"),
             ARGS, SERVER_ARGS),
    _applied("hf_checkpoint", "the checkpoint the engines load and the tokenizer comes from (and the trainer's "
             "base unless --ref-load)", (LOOP, "tokenizer_path"), SERVER_ARGS),
    _applied("ref_load", "the torch_dist checkpoint the megatron trainer loads its frozen base from",
             LOOP, WORKER, MEGATRON_POLICY, only_with=MEGATRON),
    _applied("backend", "the trainer: torch (PolicyTrainer) or megatron (MegatronPolicy)", LOOP, WORKER),
    # ------------------------------------------------------------------ cluster
    _derived("num_nodes", "training nodes: the layout's world size and the Ray placement", _LAYOUT, ARGS,
             "k3/launch/placement.py"),
    _derived("num_gpus_per_node", "GPUs per node (0: CPU): the layout, the placement bundles and the engines",
             _LAYOUT, ARGS, "k3/launch/placement.py", SERVER_ARGS),
    _applied("external_ray", "join the running Ray cluster instead of starting one", "k3/launch/placement.py"),
    _derived("extra_env_vars", "KEY=VALUE pairs added to every Ray worker's env", ("env",)),
    _applied("distributed_timeout_minutes", "timeout of every process group's collectives", LOOP, WORKER,
             MEGATRON_POLICY, "k3/megatron/parallel.py"),
    _applied("env", "the environment of every Ray worker (JSON only)", ("k3/launch/placement.py", "env")),
    _applied("profile_train_step", "the optimizer step every trainer rank runs under torch.profiler (None: none)",
             LOOP, WORKER),
    # ------------------------------------------------------------------ parallelism
    _derived("pipeline_parallel_size", "pipeline stages asked for", ("pipeline_model_parallel_size",
             "pipeline_layers", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
             "tensor_model_parallel_size", "data_parallel_size", "expert_model_parallel_size")),
    _applied("context_parallel_size", "context-parallel ranks per sequence", ("k3/megatron/parallel.py", "cp"),
             ("k3/megatron/config.py", "cp")),
    _derived("tp_size_override", "tensor-parallel size instead of the derived one",
             ("tensor_model_parallel_size", "data_parallel_size", "expert_model_parallel_size")),
    _derived("ep_size_override", "expert-parallel size instead of the derived one", ("expert_model_parallel_size",)),
    _applied("world_size", "training ranks: one trainer actor per rank, one placement bundle per rank",
             LOOP, "k3/launch/placement.py"),
    _applied("tensor_model_parallel_size", "megatron's TP size", ("k3/megatron/parallel.py", "tp"),
             ("k3/megatron/config.py", "tp")),
    _applied("pipeline_model_parallel_size", "megatron's PP size", ("k3/megatron/parallel.py", "pp"),
             ("k3/megatron/config.py", "pp")),
    _info("data_parallel_size", "data-parallel replicas", "what remains of world_size after TP × CP × PP; megatron's "
          "process groups derive the same from the world size (k3/megatron/parallel.py)",
          pinned=lambda d: d["world_size"] // (d["tensor_model_parallel_size"] * d["context_parallel_size"]
                                               * d["pipeline_model_parallel_size"])),
    _applied("expert_model_parallel_size", "megatron's EP size (routed experts per rank = experts / EP)",
             ("k3/megatron/parallel.py", "ep"), ("k3/megatron/config.py", "ep")),
    _applied("expert_tensor_parallel_size", "megatron's expert TP size (K3 needs 1)", "k3/megatron/config.py"),
    _applied("sequence_parallel", "sequence parallelism (on whenever TP > 1); the LoRA gradient sums follow it",
             "k3/lora/sharding.py"),
    _info("num_layers", "decoder layers of the variant", "the layer count the pipeline split is derived from; the "
          "trainer builds the layers of the checkpoint's config (k3 train --dry-run compares the two)"),
    _info("pipeline_layers", "decoder layers per pipeline stage", "the split that decoder_first/last_pipeline_"
          "num_layers give megatron, spelled out for the reader"),
    _applied("decoder_first_pipeline_num_layers", "layers of the first stage under an uneven split",
             ("k3/megatron/config.py", "first_stage_layers")),
    _applied("decoder_last_pipeline_num_layers", "layers of the last stage under an uneven split",
             ("k3/megatron/config.py", "last_stage_layers")),
    _applied("rollout_tp_size", "TP size of each rollout engine: which trainer rank feeds which engine",
             LOOP, "k3/rollout/sglang/start.py"),
    _derived("rollout_ep_size", "EP size of each rollout engine", ("sglang_ep_size",)),
    _applied("num_rollout_engines", "rollout engines started over the run's GPUs",
             ("k3/rollout/sglang/start.py", "num_rollout_engines")),
    # ------------------------------------------------------------------ rollout
    _applied("rollout_engine", "the rollout engine: embedded or sglang", LOOP),
    _applied("sglang_path", "the directory holding sglang/ (on the workers' PYTHONPATH)",
             "k3/rollout/sglang/kind.py", only_with=SGLANG),
    _applied("rollout_max_concurrency", "requests an engine runs at once", "k3/rollout/embedded/start.py",
             SERVER_ARGS),
    _applied("sglang_max_total_tokens", "cap of SGLang's KV token pool", SERVER_ARGS, only_with=SGLANG),
    _applied("num_rollout", "rollouts the run takes", LOOP),
    _applied("rollout_batch_size", "prompts per rollout", LOOP),
    _applied("n_samples_per_prompt", "responses per prompt (one GRPO group)", LOOP),
    _applied("rollout_max_response_len", "max tokens of a training response", LOOP),
    _applied("offload_rollout_level", "engine memory released while the trainer runs", LOOP, "k3/rl/engines.py"),
    _applied("eval_max_response_len", "max tokens of an eval response", LOOP),
    _applied("rollout_num_gpus_per_engine", "GPUs (TP ranks) of each SGLang engine", SERVER_ARGS),
    _applied("sglang_ep_size", "EP size of each SGLang engine", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_max_running_requests", "SGLang's max_running_requests", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_max_mamba_cache_size", "SGLang's KDA state slots", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_cuda_graph_bs", "batch sizes SGLang captures CUDA graphs for", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_context_length", "SGLang's context length", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_mem_fraction_static", "SGLang's static memory fraction", SERVER_ARGS, only_with=SGLANG),
    _applied("sglang_max_lora_rank", "the largest adapter rank SGLang serves", SERVER_ARGS, only_with=SGLANG),
    _applied("check_weight_update_equal", "SGLang checks the received adapters against the trainer's checksums",
             "k3/rollout/sglang/engine.py", only_with=SGLANG, off=False),
    _applied("rollout_temperature", "sampling temperature of training rollouts", LOOP),
    _applied("rollout_top_p", "top-p of training rollouts", LOOP),
    _applied("eval_temperature", "sampling temperature of eval", LOOP),
    _applied("rollout_shuffle", "shuffle the prompts every epoch", LOOP),
    _applied("skip_eval_before_train", "skip the eval before the first rollout", LOOP),
    _info("n_samples_per_eval_prompt", "responses per eval prompt", "the loop's evaluate() generates one response "
          "per eval prompt (k3/rl/loop.py); the value states it", pinned=1),
    # ------------------------------------------------------------------ data and reward
    _derived("task", "gsm8k, dapo-math or arith: the data files, their keys, the reward and response length",
             ("prompt_data", "eval_prompt_data", "eval_dataset_name", "input_key", "label_key", "eval_input_key",
              "reward_model", "rollout_max_response_len")),
    _derived("data_dir", "directory of `k3 prepare-data`", ("prompt_data", "eval_prompt_data")),
    _applied("reward_model", "the reward function", LOOP),
    _applied("eval_interval", "evaluate every N rollouts (None: never)", LOOP),
    _applied("prompt_data", "the training prompts file", LOOP),
    _applied("eval_prompt_data", "the eval prompts file", LOOP),
    _applied("eval_dataset_name", "the eval's name in the metrics (eval/<name>)", LOOP),
    _info("input_key", "the prompt key of the training file", "the loader (k3/rl/data/records.py) reads `prompt`, "
          "or gsm8k's `messages`, whatever this says; the value names the key the task's file holds"),
    _info("label_key", "the answer key of the training file", "the loader reads `label`; the value states it",
          pinned="label"),
    _info("eval_input_key", "the prompt key of the eval file", "as input_key (None when the run does not eval)"),
    _info("apply_chat_template", "prompts go through the chat template", "the loop always encodes prompts with "
          "the chat template (k3/rl/data/chat.py: encode_prompt); the value states it", pinned=True),
    # ------------------------------------------------------------------ lora
    _applied("lora_rank", "LoRA rank r", ("k3/lora/apply.py", "rank"), ("k3/megatron/lora.py", "rank"),
             becomes=("sglang_max_lora_rank",)),
    _applied("lora_alpha", "LoRA alpha (the update is scaled by alpha / r)", ("k3/lora/apply.py", "alpha"),
             ("k3/megatron/lora.py", "scale")),
    _applied("lora_dropout", "dropout on the adapter input while training", ("k3/lora/apply.py", "dropout"),
             ("k3/megatron/lora.py", "dropout")),
    _applied("target_modules", "the adapted modules", "k3/lora/apply.py", "k3/megatron/lora.py"),
    _info("experts_shared_outer_loras", "the routed experts share their outer adapter factors", "the only layout "
          "k3's expert adapters have (k3/lora/experts.py, k3/megatron/lora.py); "
          "--no-experts-shared-outer-loras is refused", pinned=True),
    _applied("expert_lora_kernel", "how the trainer's routed-expert adapters run: torch, triton or auto",
             LOOP, WORKER, MEGATRON_POLICY),
    _applied("lora_base_cpu_backup", "the engine keeps a host copy of its base while released",
             "k3/rollout/embedded/start.py", SERVER_ARGS),
    # ------------------------------------------------------------------ training
    _applied("global_batch_size", "samples per optimizer step", LOOP),
    _applied("lr", "the learning rate in effect", LOOP),
    _applied("max_tokens_per_gpu", "token budget of one micro-batch per GPU", LOOP),
    _applied("save_interval", "save an adapter checkpoint every N rollouts (and after the last)", LOOP),
    _info("save", "where adapter checkpoints go", "the loop writes them to <run_dir>/adapters (k3/rl/resume.py); "
          "the value states it", pinned=lambda d: str(Path(d["run_dir"]) / "adapters")),
    _info("num_steps_per_rollout", "optimizer steps per rollout", "the loop takes one step per global_batch_size "
          "samples of the rollout (k3/rl/loop.py); this is their quotient",
          pinned=lambda d: d["rollout_batch_size"] * d["n_samples_per_prompt"] // d["global_batch_size"]),
    _applied("use_dynamic_batch_size", "packed micro-batches filled up to max_tokens_per_gpu, the recipe's loss",
             LOOP, WORKER, MEGATRON_POLICY, only_with=MEGATRON, off=False),
    _applied("log_probs_chunk_size", "tokens per chunk of the log-prob pass", LOOP, WORKER, MEGATRON_POLICY,
             "k3/rl/trainers/torch.py", "k3/megatron/training.py"),
    _applied("recompute_granularity", "megatron's activation recompute: full or selective", LOOP, WORKER,
             MEGATRON_POLICY, only_with=MEGATRON),
    _applied("recompute_method", "megatron's recompute method: uniform or block", LOOP, WORKER, MEGATRON_POLICY,
             only_with=MEGATRON),
    _applied("recompute_num_layers", "layers per recompute unit", LOOP, WORKER, MEGATRON_POLICY,
             only_with=MEGATRON),
    _applied("check_for_nan_in_loss_and_grad", "a NaN loss or gradient stops the run naming rank and step", LOOP,
             WORKER, MEGATRON_POLICY, "k3/rl/trainers/torch.py"),
    # ------------------------------------------------------------------ optimizer
    _applied("optimizer", "the optimizer both trainers build: sgd (debug_minimal) or adam (normal)", LOOP,
             "k3/rl/grpo.py", MEGATRON_POLICY, "k3/megatron/training.py", "k3/megatron/optimizer.py"),
    _applied("weight_decay", "the optimizer's weight decay (Adam: decoupled; SGD: added to the gradient)", LOOP),
    _applied("adam_beta1", "Adam's beta1", LOOP, ("k3/rl/grpo.py", "betas"), (MEGATRON_POLICY, "betas"),
             "k3/megatron/optimizer.py", only_with=ADAM),
    _applied("adam_beta2", "Adam's beta2", LOOP, ("k3/rl/grpo.py", "betas"), (MEGATRON_POLICY, "betas"),
             "k3/megatron/optimizer.py", only_with=ADAM),
    _applied("sgd_momentum", "SGD's momentum factor", LOOP, "k3/rl/grpo.py", MEGATRON_POLICY,
             "k3/megatron/training.py", "k3/megatron/optimizer.py", only_with=SGD),
    _info("lr_decay_style", "the learning-rate schedule", "neither trainer has a schedule: the rate stays at lr",
          pinned="constant"),
    _applied("use_distributed_optimizer", "megatron's distributed optimizer over the LoRA parameters", LOOP, WORKER,
             MEGATRON_POLICY, "k3/megatron/optimizer.py"),
    _applied("optimizer_cpu_offload", "optimizer state on the host (megatron-core's CPU offload)", LOOP, WORKER,
             MEGATRON_POLICY, "k3/megatron/optimizer.py"),
    _applied("optimizer_offload_fraction", "the share of the optimizer step run on the host", LOOP, WORKER,
             MEGATRON_POLICY, "k3/megatron/optimizer.py"),
    # ------------------------------------------------------------------ grpo
    _info("advantage_estimator", "how advantages are estimated", "the loop's GRPO: group-normalised rewards "
          "(k3/rl/grpo.py: group_advantages); the value states it", pinned="grpo"),
    _applied("eps_clip", "lower PPO clip", LOOP),
    _applied("eps_clip_high", "upper PPO clip", LOOP),
    _info("kl_loss_coef", "weight of a KL term", "the GRPO loss has no KL term and the run has no reference model "
          "(k3/rl/grpo.py: policy_loss); the value states it", pinned=0.0),
    _info("kl_loss_type", "kind of the KL term", "inert: there is no KL term (kl_loss_coef 0.0); the recipe's name",
          pinned="low_var_kl"),
    _info("entropy_coef", "weight of an entropy bonus", "the loss has no entropy bonus; the value states it",
          pinned=0.0),
    _info("rewards_normalization", "rewards are centred per group", "group_advantages always subtracts the group "
          "mean (k3/rl/grpo.py); the value states it", pinned=True),
    _applied("grpo_std_normalization", "advantages divided by the group's std", LOOP),
    _applied("grpo_std_eps", "epsilon of that division", LOOP),
    # ------------------------------------------------------------------ sync and memory
    _applied("colocate_memory_peak_device", "the order of the memory hand-off at a sync: gpu or cpu", LOOP),
    _applied("gpu_memory_fraction_per_actor", "the share of its GPU each trainer and engine actor's CUDA allocator "
             "may reserve (None: no cap)", LOOP, WORKER, "k3/rollout/embedded/worker.py"),
    _applied("gpu_memory_gb_per_actor", "the same cap in GiB of each actor's GPU (None: no cap, or the fraction "
             "above)", LOOP, WORKER, "k3/rollout/embedded/worker.py"),
    _info("colocate", "trainer and engines share the devices", "k3 always colocates (the schedule of "
          "k3/rl/colocate.py); the value states it", pinned=True),
    _applied("offload_train", "the trainer sleeps (releases its memory) while the engines generate", LOOP, WORKER),
    _applied("offload_rollout", "the engines release memory while the trainer trains", SERVER_ARGS),
    _applied("disable_weights_backuper", "the trainer keeps no host backup of its frozen base while asleep", LOOP),
    _applied("lora_transfer_buffer", "adapter chunks travel through one persistent buffer",
             (LOOP, "lora_transfer_buffer"), (WORKER, "transfer_buffer")),
    _derived("ipc_unlink_shim", "LD_PRELOAD the shm_unlink shim in every worker", ("env",)),
    # ------------------------------------------------------------------ logging
    _applied("enable_wandb", "log metrics to Weights & Biases", LOOP),
)

REGISTRY: dict[str, ResolvedKey] = {e.name: e for e in _ENTRIES}

# Settings fields the dump leaves out: nothing applies them (each says why).
NOT_PRINTED: dict[str, str] = {
    "train_memory_margin_bytes": "no code keeps such a margin: the engines' memory is sized by "
                                 "sglang_mem_fraction_static / sglang_max_total_tokens",
    "sglang_server_concurrency": "k3 drives SGLang's engine in process; there is no HTTP server to limit",
}

# Settings fields printed under another name: "<Settings class>.<field>" -> the printed key (same value).
FIELD_SOURCES: dict[str, str] = {
    "RunSettings.tokenizer_path": "hf_checkpoint",
    "LoRAConfig.rank": "lora_rank",
    "LoRAConfig.alpha": "lora_alpha",
    "LoRAConfig.dropout": "lora_dropout",
    "LoRAConfig.experts_shared_outer": "experts_shared_outer_loras",
}


def condition_holds(entry: ResolvedKey, values: Mapping[str, Any]) -> bool:
    """Whether ``entry`` is applied in a run with these printed ``values`` (always, without ``only_with``)."""
    if entry.only_with is None:
        return True
    key, wanted = entry.only_with
    return values.get(key) == wanted


def resolved_value(name: str, value: Any, values: Mapping[str, Any]) -> Any:
    """What the dump prints for ``name``: ``value``, or the entry's ``off`` when its ``only_with`` does not hold."""
    entry = REGISTRY.get(name)
    if entry is None or condition_holds(entry, values):
        return value
    return entry.off


def registry_markdown() -> str:
    """``docs/RESOLVED_KEYS.md``: one table row per key (what it does, who applies it), then the keys left out."""
    lines = [
        "# What each resolved key does",
        "",
        "Generated from `k3/launch/resolved_keys.py` (`python -m k3.launch.resolved_keys > docs/RESOLVED_KEYS.md`);",
        "`tests/unit/test_resolved_key_registry.py` checks that it is current and that every reader named here",
        "reads its key. *applied*: the modules that read the value (`.name` / `name=`), the settings reader first;",
        "*derived*: a flag the launcher turns into the keys listed; *informational*: nothing reads it, and why it",
        "is printed. A key marked *only with* is printed as its off value when the condition does not hold. Keys",
        "whose wiring is still in flight are listed in `PENDING` in that test (their reader check is an expected",
        "failure until the wiring lands).",
        "",
        "| key | does | kind | applied by |",
        "|---|---|---|---|",
    ]
    for name in sorted(REGISTRY, key=str.lower):
        e = REGISTRY[name]
        if e.informational:
            where = e.informational
        else:
            where = ", ".join(f"`{r.module}` (`{r.name}`)" for r in e.readers)
            if e.becomes:
                where += "; becomes " + ", ".join(f"`{b}`" for b in e.becomes)
        if e.only_with is not None:
            where += f"; only with `{e.only_with[0]} {e.only_with[1]}` (else `{e.off}`)"
        lines.append(f"| `{name}` | {e.does} | {e.kind} | {where.replace('|', '/')} |")
    lines += ["", "## Settings fields not printed", "", "| field | why |", "|---|---|"]
    lines += [f"| `{name}` | {why} |" for name, why in sorted(NOT_PRINTED.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(registry_markdown(), end="")
