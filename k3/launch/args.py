"""`k3 train` arguments: the recipe launcher's flags (``miles-k3-recipe.md`` §6.1) plus ours, and their
resolution into the configuration a run actually uses.

:class:`TrainArgs` holds one field per flag; the field ``rollout_batch_size`` is the flag
``--rollout-batch-size`` and the environment variable ``K3_ROLLOUT_BATCH_SIZE`` (the recipe's
``MILES_SCRIPT_<FIELD>``). A ``None`` default means "depends on --mode / --task / --model-variant";
:func:`resolve` fills those in, derives the parallel layout, validates everything and returns a
:class:`ResolvedConfig`. Errors are :class:`LaunchConfigError` and say which flag to change and to what.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3.config import variant
from k3.launch.layout import LayoutError, derive_layout
from k3.launch.resolved_keys import NOT_PRINTED, resolved_value
from k3.rollout.registry import DEFAULT_ENGINE, ENGINE_NAMES, ENGINES, engine_kind
from k3.settings.colocate import OFFLOAD_ROLLOUT_LEVELS, PEAK_DEVICES, ColocateSettings
from k3.settings.data import DataSettings
from k3.settings.lora import LoRAConfig, optional_target_names, target_names
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import ROLLOUT_MAX_CONCURRENCY, SGLANG_PATH, RolloutSettings
from k3.settings.run import RunSettings
from k3.settings.train import BACKENDS, EXPERT_LORA_KERNELS, GRPOSettings, OptimizerSettings, TrainingSettings

__all__ = [
    "TrainArgs",
    "ResolvedConfig",
    "LaunchConfigError",
    "resolve",
    "flag_was_given",
    "new_run_id",
    "MODES",
    "TASKS",
    "MODEL_VARIANTS",
    "REWARD_MODELS",
    "ENV_PREFIX",
]

MODES = ("debug_minimal", "normal")
TASKS = ("gsm8k", "dapo-math", "arith")
MODEL_VARIANTS = ("tiny", "4layer", "full")
REWARD_MODELS = ("deterministic_random", "deepscaler", "math")
ENV_PREFIX = "K3_"

# Recipe paths for the 4layer default and what `full` switches them to when left at the default.
_PATHS_4LAYER = {
    "hf_checkpoint": "/root/models/Kimi-K3-4layer-bf16",
    "ref_load": "/root/models/Kimi-K3-4layer-torch-dist",
}
_PATHS_FULL = {
    "hf_checkpoint": "/root/models/Kimi-K3/native",
    "ref_load": "/root/models/Kimi-K3/torch_dist",
}
_GIB = 1024**3


class LaunchConfigError(ValueError):
    """A flag value `k3 train` cannot run with; the message names the flag and what to change."""


def _default_num_nodes() -> int:
    # The recipe's base class: the Slurm allocation's node count when there is one.
    value = os.environ.get("SLURM_JOB_NUM_NODES", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def opt(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None, group: str = "run",
        factory: Any = None, metavar: str | None = None, ours: bool = False) -> Any:
    """A :class:`TrainArgs` field with its CLI metadata: one-line ``help``, ``choices``, help ``group``.

    ``ours`` marks flags the public recipe launcher does not have.
    """
    meta = {"help": help, "choices": choices, "group": group, "metavar": metavar, "ours": ours}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainArgs:
    """Every `k3 train` flag. ``None`` = resolved from --mode / --task / --model-variant (see :func:`resolve`)."""

    # --- run
    mode: str = opt("debug_minimal", "debug_minimal: tiny sizes, lr 1e-6, no weight decay; normal: the recipe's sizes",
                    choices=MODES)
    run_id: str | None = opt(None, "run name: save subdir and wandb group (default: UTC time + random suffix)")
    run_dir: str | None = opt(None, "run directory: metrics.jsonl, resolved_config.*, adapters/ "
                              "(default: runs/<run-id>)", ours=True)
    resume: bool = opt(False, "continue the run in --run-dir from its latest adapter checkpoint", ours=True)
    seed: int = opt(1234, "random seed of data order, sampling and LoRA init", ours=True)
    dry_run: bool = opt(False, "resolve, validate and write the resolved config, then exit without training",
                        ours=True)
    output_dir: str = opt("/root/shared_data", "shared output directory of the recipe (CUDA core dumps go here)")
    # --- model
    model_variant: str = opt("4layer", "tiny (CPU width, ours), 4layer (first 4 layers, one 8-GPU node) or full "
                             "(16×4 GPUs)", choices=MODEL_VARIANTS, group="model")
    hf_checkpoint: str | None = opt(_PATHS_4LAYER["hf_checkpoint"], "HF checkpoint the engine loads (full: switched to "
                             f"{_PATHS_FULL['hf_checkpoint']} when left at the default; tiny: required)", group="model")
    ref_load: str | None = opt(_PATHS_4LAYER["ref_load"], "torch_dist (DCP) checkpoint of the base for the Megatron "
                        f"trainer (full: switched to {_PATHS_FULL['ref_load']})", group="model")
    backend: str = opt("torch", "trainer backend: torch (plain PyTorch) or megatron (megatron-core; needs CUDA, "
                       "one training rank for now)",
                       choices=BACKENDS, group="model", ours=True)
    # --- cluster
    num_nodes: int = opt(help="training nodes ($SLURM_JOB_NUM_NODES when set, else 1)", group="cluster",
                         factory=_default_num_nodes)
    num_gpus_per_node: int | None = opt(None, "GPUs per node; 0 = CPU (default: 8; tiny: 0)", group="cluster")
    external_ray: bool = opt(False, "join the running Ray cluster (RAY_ADDRESS or auto) instead of starting one",
                             group="cluster")
    extra_env_vars: str = opt("", "extra KEY=VALUE pairs (space-separated) for every Ray worker", group="cluster")
    profile_train_step: int | None = opt(
        None, "run optimizer step N (0 = the first) under torch.profiler on every trainer rank and write where its "
        "time went to <run_dir>/profile/train_step_N_rank<R>.txt (and .json): the most expensive GPU kernels (CPU "
        "operators without a GPU), each with the operators, input shapes and line of code that launched it; on a "
        "GPU, step N + 1 then runs with the allocator's history recorded, and what it leaves allocated goes to "
        "train_step_<N+1>_memory_rank<R>.txt (and .json), summed by the line that allocated it; both steps run as "
        "usual, a little slower, and their cycle times are left out of the cycle-time check (default: none)",
        group="logging", ours=True)
    cuda_core_dump: bool = opt(False, "write a CUDA core dump to --output-dir when a kernel faults",
                               group="cluster")
    distributed_timeout_minutes: int = opt(10, "timeout of collective operations, minutes", group="cluster")
    # --- parallelism
    pipeline_parallel_size: int = opt(1, "pipeline stages (full: must divide 64 and split the 93 layers)",
                                      group="parallelism")
    context_parallel_size: int = opt(1, "context-parallel ranks per sequence", group="parallelism")
    tp_size_override: int | None = opt(None, "tensor parallel size instead of the derived one",
                                       group="parallelism")
    ep_size_override: int | None = opt(None, "expert parallel size instead of the derived one",
                                       group="parallelism")
    # --- rollout
    rollout_engine: str = opt(DEFAULT_ENGINE, "rollout engine: " + " or ".join(f"{k.name} ({k.summary})"
                                                                            for k in ENGINES.values()),
                              choices=ENGINE_NAMES, group="rollout", ours=True)
    sglang_path: str = opt(SGLANG_PATH, "directory containing the sglang/ package", group="rollout")
    rollout_tp_size: int = opt(8, "tensor parallel size of each rollout engine (full only; divides 64 and 96)",
                               group="rollout")
    rollout_ep_size: int = opt(1, "expert parallel size of each rollout engine (full only; divides rollout TP "
                               "and 896)", group="rollout")
    rollout_max_concurrency: int = opt(ROLLOUT_MAX_CONCURRENCY, "requests an engine runs at once", group="rollout")
    sglang_max_total_tokens: int | None = opt(None, "cap of the engine's KV token pool", group="rollout")
    num_rollout: int | None = opt(None, "rollouts to run (debug_minimal 2, normal 3000)", group="rollout")
    rollout_batch_size: int | None = opt(None, "prompts per rollout (debug_minimal 8, normal 32)",
                                         group="rollout")
    n_samples_per_prompt: int | None = opt(None, "responses per prompt, one GRPO group (debug_minimal 2, "
                                           "normal 8)", group="rollout")
    rollout_max_response_len: int | None = opt(None, "max response tokens, also for eval (gsm8k 256; else "
                                               "debug_minimal 32, normal 16384)", group="rollout")
    offload_rollout_level: list[str] = opt(help="engine memory released while the trainer runs: kv_cache, "
                                           "weight", group="rollout", factory=lambda: ["kv_cache", "weight"],
                                           choices=OFFLOAD_ROLLOUT_LEVELS, ours=True)
    # --- data and reward
    task: str = opt("gsm8k", "training task: gsm8k, dapo-math (eval on aime-2024) or arith (generated, for the "
                    "smoke)", choices=TASKS, group="data")
    data_dir: str = opt("/root/datasets", "datasets directory of `k3 prepare-data`", group="data")
    reward_model: str | None = opt(None, "reward: math for gsm8k; dapo-math: deterministic_random "
                                   "(debug_minimal) or deepscaler (normal)", choices=REWARD_MODELS, group="data")
    eval_interval: int | None = opt(None, "evaluate every N rollouts, and before training (default: no eval)",
                                    group="data")
    # --- lora
    lora_rank: int = opt(16, "LoRA rank r (> 0)", group="lora")
    lora_alpha: int = opt(32, "LoRA alpha; the update is scaled by alpha / rank", group="lora")
    lora_dropout: float = opt(0.0, "dropout on the adapter input while training", group="lora")
    # The LoRA target table's rows (k3/settings/lora.py: the recipe's set, §4.1, Megatron module names under
    # `decoder.layers.*.`); all are required but the rows marked optional.
    target_modules: list[str] = opt(help=f"adapted modules (the recipe's {len(target_names())}; only "
                                    f"{', '.join(optional_target_names())} may be left out)", group="lora",
                                    factory=lambda: list(target_names()))
    experts_shared_outer_loras: bool = opt(True, "share the outer expert factors over all experts (required)",
                                           group="lora")
    expert_lora_kernel: str = opt("auto", "how the trainer's routed-expert adapters run their rank-r grouped GEMMs: "
                                  "triton (kernels that add into the frozen base's output; needs CUDA and Triton; "
                                  "H200: +8-9% over the frozen experts' fwd+bwd vs +15-17% for torch), torch "
                                  "(grouped_mm), or auto (triton where it runs, else torch)",
                                  choices=EXPERT_LORA_KERNELS, group="lora", ours=True)
    lora_base_cpu_backup: bool = opt(True, "engine keeps a host copy of its frozen base while released, so the "
                                     "trainer never re-sends it", group="lora", ours=True)
    # --- training
    global_batch_size: int | None = opt(None, "samples per optimizer step (debug_minimal 16, normal 256)",
                                        group="training")
    lr: float = opt(1e-5, "Adam learning rate (normal mode; debug_minimal uses 1e-6)", group="training")
    max_tokens_per_gpu: int | None = opt(None, "token budget of one micro-batch per GPU (4layer 512, full 8192)",
                                         group="training")
    save_interval: int = opt(50, "save a checkpoint every N rollouts (and after the last)", group="training",
                             ours=True)
    # --- sync and memory
    offload_train: bool = opt(True, "the trainer sleeps while the engines generate: parameters paused with a host "
                              "backup, gradient buffers dropped (torch_memory_saver on CUDA, a host move on CPU), "
                              "woken to train; --no-offload-train keeps it resident", group="sync")
    colocate_memory_peak_device: str = opt("gpu", "where trainer and engine copies briefly coexist at a sync: "
                                           "gpu (onload first) or cpu (offload first)", choices=PEAK_DEVICES,
                                           group="sync", ours=True)
    lora_transfer_buffer: bool = opt(False, "export every adapter chunk into one persistent buffer that the "
                                     "engine maps once (the recipe's IPC transfer-buffer variant) instead of a "
                                     "fresh bucket per chunk", group="sync", ours=True)
    gpu_memory_fraction_per_actor: float | None = opt(
        None, "share of its GPU each actor's CUDA allocator may reserve (0 < X <= 1; every trainer rank and the "
        "embedded engine call torch.cuda.set_per_process_memory_fraction at start, so an actor that allocates past "
        "it fails with an out-of-memory error); a per-process cap, not a limit on the sum of the actors on one GPU; "
        "GPU runs with the embedded engine only (default: no cap)", group="sync", ours=True)
    gpu_memory_gb_per_actor: float | None = opt(
        None, "the same cap in GiB of the actor's GPU (X > 0, at most the device's memory; the actor turns it into "
        "the fraction X GiB / its device's total), so one value means the same bytes on an 80 GB and a 141 GB "
        "card; not with --gpu-memory-fraction-per-actor (default: no cap)", group="sync", ours=True)
    check_weight_update_equal: bool = opt(False, "check the engine's weights equal the trainer's after the "
                                          "first sync", group="sync")
    ipc_unlink_shim: bool | None = opt(None, "LD_PRELOAD the shm_unlink shim in every worker, so an already "
                                       "removed /torch_* CUDA-IPC file does not abort a weight sync (default: on "
                                       "with GPUs, off on CPU; needs a C compiler, skipped with a note "
                                       "without one)", group="sync", ours=True)
    # --- logging
    enable_wandb: bool = opt(False, "log metrics to Weights & Biases (project miles-run_kimi_k3_lora)",
                             group="logging")


@dataclass(frozen=True)
class ResolvedConfig:
    """What a run uses: every flag with its default filled in (``args``), the typed settings built from them
    once (``settings``: what ``k3.rl.loop.run`` takes, each part its own section), the Ray workers' ``env`` and
    the notes printed at startup.

    ``to_dict()`` flattens the flags and the settings sections into one name → value mapping (Megatron's names
    where Megatron has one; a name in two sections has one value): that is what ``resolved_config.json`` /
    ``.txt`` hold.
    """

    args: TrainArgs
    settings: RunSettings
    env: dict[str, str]
    notes: tuple[str, ...] = ()

    # The settings sections of the dump, after the flags (the flags' own values lead).
    SECTIONS = ("layout", "optimizer", "grpo", "rollout", "data", "colocate", "training")

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{name: value}`` of the flags and every section (JSON-ready: tuples as lists), plus ``env``.

        Only what is in effect (``k3.launch.resolved_keys``): the settings fields nothing applies
        (``NOT_PRINTED``) are left out, and a key applied only by another backend or engine than this run's
        (``only_with``) holds its off value (``recompute_granularity None`` under ``--backend torch``).
        """
        out: dict[str, Any] = {}
        for section in (self.args, *(getattr(self.settings, name) for name in self.SECTIONS)):
            for key, value in dataclasses.asdict(section).items():
                if key in NOT_PRINTED:
                    continue
                value = list(value) if isinstance(value, tuple) else value
                # A name may appear in two sections (the flag and the layout both hold context_parallel_size)
                # only with one value.
                if key in out and out[key] != value:
                    raise AssertionError(f"resolved key {key!r} differs between sections: {out[key]!r} vs {value!r}")
                out[key] = value
        out = {key: resolved_value(key, value, out) for key, value in out.items()}
        out["env"] = dict(self.env)
        return out

    @property
    def layout(self) -> ParallelLayout:
        return self.settings.layout

    @property
    def optimizer(self) -> OptimizerSettings:
        return self.settings.optimizer

    @property
    def grpo(self) -> GRPOSettings:
        return self.settings.grpo

    @property
    def rollout(self) -> RolloutSettings:
        return self.settings.rollout

    @property
    def colocate(self) -> ColocateSettings:
        return self.settings.colocate

    @property
    def data(self) -> DataSettings:
        return self.settings.data

    @property
    def training(self) -> TrainingSettings:
        return self.settings.training

    @property
    def run_dir(self) -> Path:
        return self.settings.run_dir

    @property
    def uses_gpus(self) -> bool:
        return self.settings.uses_gpus


def flag_was_given(args: TrainArgs, name: str) -> bool:
    """Whether the resolved ``args`` hold a value for flag ``name`` other than the one it gets when not given (the
    field's default; for the recipe's checkpoint paths, either variant's default or none)."""
    value = getattr(args, name)
    if name in _PATHS_4LAYER:
        return value not in (None, _PATHS_4LAYER[name], _PATHS_FULL[name])
    default = next(f for f in dataclasses.fields(TrainArgs) if f.name == name).default
    return value != default


def new_run_id() -> str:
    """``20260102-030405-1a2b3c``: UTC time plus a random suffix, as the recipe names runs."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _fail(message: str) -> LaunchConfigError:
    return LaunchConfigError(message)


def _check_positive(args: TrainArgs, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise _fail(f"--{name.replace('_', '-')} {value}: must be > 0")


def _check_choice(args: TrainArgs, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(args, name)
    if value not in choices:
        raise _fail(f"--{name.replace('_', '-')} {value!r}: expected one of {', '.join(choices)}")


def parse_env_pairs(text: str) -> dict[str, str]:
    """``"A=1 B='x y'"`` → ``{"A": "1", "B": "x y"}`` (shell quoting); raises on a word without ``=``."""
    out: dict[str, str] = {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise _fail(f"--extra-env-vars: {word!r} is not KEY=VALUE (pairs are space-separated)")
        out[key] = value
    return out


def _worker_env(a: TrainArgs, rollout: RolloutSettings) -> dict[str, str]:
    """Environment of every Ray worker (recipe §6.1 "Environment passed to Ray")."""
    env: dict[str, str] = {}
    repo_root = str(Path(__file__).resolve().parents[2])
    engine = engine_kind(a.rollout_engine)
    python_path = [repo_root, *engine.python_path(rollout)]
    env.update(engine.worker_env(rollout))
    if os.environ.get("PYTHONPATH"):
        python_path.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    if a.num_gpus_per_node:
        env["NCCL_TIMEOUT"] = "3600"
    # Without the compile caches the KDA backward kernels recompile on every run (~30 min first backward).
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK",
                 "SGLANG_K3_ATTN_RES_MODE"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    if a.cuda_core_dump:
        env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] = "1"
        env["CUDA_COREDUMP_FILE"] = str(Path(a.output_dir) / "cuda_coredump_%h.%p.%t")
    env.update(parse_env_pairs(a.extra_env_vars))
    return env


def resolve(args: TrainArgs) -> ResolvedConfig:
    """Fill the mode/task/variant-dependent defaults, derive the layout and validate every flag.

    ``args`` is not modified. Raises :class:`LaunchConfigError` (a ``ValueError``) naming the flag to change.
    """
    a = dataclasses.replace(args, target_modules=list(args.target_modules),
                            offload_rollout_level=list(args.offload_rollout_level))
    notes: list[str] = []
    for name, choices in [("mode", MODES), ("task", TASKS), ("model_variant", MODEL_VARIANTS),
                          ("backend", BACKENDS), ("rollout_engine", ENGINE_NAMES),
                          ("colocate_memory_peak_device", PEAK_DEVICES),
                          ("expert_lora_kernel", EXPERT_LORA_KERNELS)]:
        _check_choice(a, name, choices)
    if a.reward_model is not None:
        _check_choice(a, "reward_model", REWARD_MODELS)
    debug = a.mode == "debug_minimal"
    full = a.model_variant == "full"

    # Variant: paths the recipe switches when left at the 4layer default, GPUs, per-GPU token budget.
    if full:
        for name, default in _PATHS_4LAYER.items():
            if getattr(a, name) == default:
                setattr(a, name, _PATHS_FULL[name])
    elif a.model_variant == "tiny":
        # No recipe path fits tiny: its checkpoint is one the user makes (`k3 make-checkpoint --variant tiny`).
        for name in ("hf_checkpoint", "ref_load"):
            if getattr(a, name) == _PATHS_4LAYER[name]:
                setattr(a, name, None)
    if a.num_gpus_per_node is None:
        a.num_gpus_per_node = 0 if a.model_variant == "tiny" else 8
    if a.max_tokens_per_gpu is None:
        a.max_tokens_per_gpu = 8192 if full else 512

    # Mode and task.
    if a.reward_model is None:
        a.reward_model = "math" if a.task == "gsm8k" else ("deterministic_random" if debug else "deepscaler")
    for name, debug_value, normal_value in [("num_rollout", 2, 3000), ("rollout_batch_size", 8, 32),
                                            ("n_samples_per_prompt", 2, 8), ("global_batch_size", 16, 256)]:
        if getattr(a, name) is None:
            setattr(a, name, debug_value if debug else normal_value)
    if a.rollout_max_response_len is None:
        a.rollout_max_response_len = 256 if a.task == "gsm8k" else (32 if debug else 16384)
    if debug and a.lr != TrainArgs.lr:
        notes.append(f"--lr {a.lr} is ignored in --mode debug_minimal (lr 1e-6); use --mode normal")
    if debug:
        a.lr = 1e-6
    if a.run_id is None:
        a.run_id = new_run_id()
    if a.run_dir is None:
        a.run_dir = str(Path("runs") / a.run_id)

    _validate_values(a)
    model = variant(a.model_variant)
    rollout_defaults = (TrainArgs.rollout_tp_size, TrainArgs.rollout_ep_size)
    try:
        layout = derive_layout(
            a.model_variant,
            num_nodes=a.num_nodes,
            num_gpus_per_node=a.num_gpus_per_node,
            pipeline_parallel_size=a.pipeline_parallel_size,
            context_parallel_size=a.context_parallel_size,
            tp_size_override=a.tp_size_override,
            ep_size_override=a.ep_size_override,
            rollout_tp_size=a.rollout_tp_size,
            rollout_ep_size=a.rollout_ep_size,
            num_layers=model.num_hidden_layers,
            num_attention_heads=model.num_attention_heads,
            num_experts=model.num_experts,
            rollout_defaults=rollout_defaults,
        )
    except LayoutError as e:
        raise LaunchConfigError(str(e)) from None
    _validate_batches(a, layout)
    # The resolved flags show what the engines run with (the 4layer and tiny engines ignore the full-only flags).
    a.rollout_tp_size, a.rollout_ep_size = layout.rollout_tp_size, layout.rollout_ep_size

    rollout = _rollout(a, layout)
    env = _worker_env(a, rollout)
    if a.ipc_unlink_shim is None:
        a.ipc_unlink_shim = bool(a.num_gpus_per_node)  # the race is CUDA IPC's; CPU sharing has no ref files
    if a.ipc_unlink_shim:
        from k3.transport.shim import ShimBuildError, shim_env

        try:
            env["LD_PRELOAD"] = shim_env({"LD_PRELOAD": env.get("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))})[
                "LD_PRELOAD"]
        except ShimBuildError as e:  # optional: report it and run without
            a.ipc_unlink_shim = False
            notes.append(f"--ipc-unlink-shim is off: {e}")
    settings = RunSettings(
        run_dir=Path(a.run_dir),
        run_id=a.run_id,
        seed=a.seed,
        resume=a.resume,
        num_rollout=a.num_rollout,
        rollout_batch_size=a.rollout_batch_size,
        n_samples_per_prompt=a.n_samples_per_prompt,
        global_batch_size=a.global_batch_size,
        eval_interval=a.eval_interval,
        save_interval=a.save_interval,
        reward_model=a.reward_model,
        tokenizer_path=a.hf_checkpoint,
        rollout_engine=a.rollout_engine,
        enable_wandb=a.enable_wandb,
        layout=layout,
        lora=LoRAConfig(rank=a.lora_rank, alpha=float(a.lora_alpha), dropout=a.lora_dropout,
                        target_modules=tuple(a.target_modules), experts_shared_outer=a.experts_shared_outer_loras),
        optimizer=_optimizer(a, notes),
        grpo=GRPOSettings(),
        rollout=rollout,
        data=_data(a),
        colocate=ColocateSettings(
            colocate=True,
            offload_train=a.offload_train,
            offload_rollout=True,
            disable_weights_backuper=True,
            train_memory_margin_bytes=(2 if debug else 4) * _GIB,
            colocate_memory_peak_device=a.colocate_memory_peak_device,
            offload_rollout_level=tuple(a.offload_rollout_level),
            gpu_memory_fraction_per_actor=a.gpu_memory_fraction_per_actor,
            gpu_memory_gb_per_actor=a.gpu_memory_gb_per_actor,
        ),
        training=TrainingSettings(
            num_steps_per_rollout=a.rollout_batch_size * a.n_samples_per_prompt // a.global_batch_size,
            use_dynamic_batch_size=True,
            log_probs_chunk_size=512,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            # The recipe turns Megatron's NaN check off for 4layer only.
            check_for_nan_in_loss_and_grad=a.model_variant != "4layer",
            save=str(Path(a.run_dir) / "adapters"),  # where k3.rl.resume writes the adapter checkpoints
            backend=a.backend,
            expert_lora_kernel=a.expert_lora_kernel,
            lora_transfer_buffer=a.lora_transfer_buffer,
            ref_load=a.ref_load,
            max_tokens_per_gpu=a.max_tokens_per_gpu,
            distributed_timeout_minutes=a.distributed_timeout_minutes,
            profile_train_step=a.profile_train_step,
        ),
    )
    return ResolvedConfig(args=a, settings=settings, env=env, notes=tuple(notes))


def _validate_values(a: TrainArgs) -> None:
    _check_positive(a, ["num_rollout", "rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len",
                        "global_batch_size", "lr", "max_tokens_per_gpu", "rollout_max_concurrency",
                        "sglang_max_total_tokens", "eval_interval", "lora_rank", "lora_alpha",
                        "distributed_timeout_minutes", "save_interval"])
    if not 0.0 <= a.lora_dropout < 1.0:
        raise _fail(f"--lora-dropout {a.lora_dropout}: must be in [0, 1)")
    if a.seed < 0:
        raise _fail(f"--seed {a.seed}: must be >= 0")
    targets, optional = target_names(), optional_target_names()
    unknown = [m for m in a.target_modules if m not in targets]
    if unknown:
        raise _fail(f"--target-modules: unknown {', '.join(unknown)}; allowed: {' '.join(targets)}")
    missing = [m for m in targets if m not in a.target_modules and m not in optional]
    if missing:
        raise _fail(f"--target-modules must include {', '.join(missing)} (only "
                    f"{', '.join(optional)} may be left out)")
    if len(set(a.target_modules)) != len(a.target_modules):
        raise _fail(f"--target-modules lists a module twice: {' '.join(a.target_modules)}")
    if not a.experts_shared_outer_loras:
        raise _fail("--no-experts-shared-outer-loras is not supported: K3's 896-expert adapters share their outer "
                    "factors; drop the flag")
    bad_levels = [x for x in a.offload_rollout_level if x not in OFFLOAD_ROLLOUT_LEVELS]
    if bad_levels:
        raise _fail(f"--offload-rollout-level: unknown {', '.join(bad_levels)}; allowed: "
                    f"{' '.join(OFFLOAD_ROLLOUT_LEVELS)}")
    if a.lora_base_cpu_backup and "weight" not in a.offload_rollout_level:
        # The host mirror is built when the engine releases its weights; without that release it never exists.
        raise _fail(f"--lora-base-cpu-backup needs 'weight' in --offload-rollout-level (got "
                    f"{' '.join(a.offload_rollout_level) or 'nothing'}): add weight, or pass "
                    "--no-lora-base-cpu-backup")
    engine = engine_kind(a.rollout_engine)
    if a.num_gpus_per_node == 0 and engine.needs_gpus:
        on_cpu = " or ".join(k.name for k in ENGINES.values() if not k.needs_gpus)
        raise _fail(f"--rollout-engine {engine.name} needs GPUs (--num-gpus-per-node 0 is CPU): use --rollout-engine "
                    f"{on_cpu} on CPU")
    parse_env_pairs(a.extra_env_vars)
    _validate_memory_fraction(a)


# The engines that apply --gpu-memory-fraction-per-actor / --gpu-memory-gb-per-actor in their actor (SGLang sizes
# itself with its own mem_fraction_static and takes no cap from us).
MEMORY_FRACTION_ENGINES = ("embedded",)


def _validate_memory_fraction(a: TrainArgs) -> None:
    """--gpu-memory-fraction-per-actor in (0, 1] or --gpu-memory-gb-per-actor > 0 (not both), on a GPU run whose
    every actor applies it (printed = applied). Whether the GiB fit the device is known only where the actor runs
    (k3.transport.memory_cap)."""
    fraction, gb = a.gpu_memory_fraction_per_actor, a.gpu_memory_gb_per_actor
    if fraction is None and gb is None:
        return
    if fraction is not None and gb is not None:
        raise _fail(f"--gpu-memory-fraction-per-actor {fraction} and --gpu-memory-gb-per-actor {gb} are the same cap "
                    "in two units: give one")
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise _fail(f"--gpu-memory-fraction-per-actor {fraction}: must be in (0, 1] (a share of one GPU)")
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        raise _fail(f"--gpu-memory-gb-per-actor {gb}: must be a positive number of GiB")
    flag = (f"--gpu-memory-fraction-per-actor {fraction}" if gb is None else f"--gpu-memory-gb-per-actor {gb}")
    if not a.num_gpus_per_node:
        raise _fail(f"{flag} caps each actor's CUDA allocator, and this run is on CPU (--num-gpus-per-node 0): "
                    "drop the flag")
    if a.rollout_engine not in MEMORY_FRACTION_ENGINES:
        raise _fail(f"{flag.split()[0]} is applied by the trainer and the {' / '.join(MEMORY_FRACTION_ENGINES)} "
                    f"engine; --rollout-engine {a.rollout_engine} sizes its own memory (sglang_mem_fraction_static): "
                    "drop the flag or use --rollout-engine embedded")


def _validate_batches(a: TrainArgs, layout: ParallelLayout) -> None:
    per_rollout = a.rollout_batch_size * a.n_samples_per_prompt
    if per_rollout % a.global_batch_size:
        fits = [g for g in range(per_rollout, 0, -1) if per_rollout % g == 0 and g % layout.data_parallel_size == 0]
        raise _fail(
            f"--rollout-batch-size {a.rollout_batch_size} × --n-samples-per-prompt {a.n_samples_per_prompt} = "
            f"{per_rollout} samples per rollout is not a multiple of --global-batch-size {a.global_batch_size}: "
            f"use a global batch that divides {per_rollout} (e.g. {', '.join(map(str, fits[:3]))})"
        )
    if a.global_batch_size % layout.data_parallel_size:
        raise _fail(f"--global-batch-size {a.global_batch_size} must be a multiple of the data-parallel size "
                    f"{layout.data_parallel_size}")
    steps = a.num_rollout * (per_rollout // a.global_batch_size)
    if a.profile_train_step is not None and not 0 <= a.profile_train_step < steps:
        raise _fail(f"--profile-train-step {a.profile_train_step}: this run makes {steps} optimizer steps "
                    f"(--num-rollout {a.num_rollout} × {per_rollout // a.global_batch_size} per rollout): use 0 to "
                    f"{steps - 1}")


def _optimizer(a: TrainArgs, notes: list[str]) -> OptimizerSettings:
    megatron = a.backend == "megatron"
    if a.mode == "debug_minimal":
        # The recipe's debug_minimal: SGD, momentum 0, weight decay 0, lr 1e-6, the distributed optimizer on megatron
        # (both trainers build it: k3.rl.grpo.build_optimizer, k3.megatron.optimizer). The Adam betas do not apply
        # (the dump prints them off: k3.launch.resolved_keys).
        return OptimizerSettings("sgd", 0.0, 0.9, 0.98, 0.0, "constant", megatron, False, 0.0, lr=a.lr)
    # The recipe offloads 80% of the Adam state to the host; megatron-core does that for CUDA state only, so a run
    # without GPUs (megatron on CPU: tests) prints, and runs, no offload.
    offload = megatron and bool(a.num_gpus_per_node)
    if megatron and not offload:
        notes.append("optimizer CPU offload is off: megatron-core offloads CUDA optimizer state, and this run has no "
                     "GPUs (--num-gpus-per-node 0)")
    return OptimizerSettings("adam", 0.1, 0.9, 0.98, 0.0, "constant", megatron, offload, 0.8 if offload else 0.0,
                             lr=a.lr)


def _rollout(a: TrainArgs, layout: ParallelLayout) -> RolloutSettings:
    full = a.model_variant == "full"
    concurrency = a.rollout_max_concurrency
    return RolloutSettings(
        eval_max_response_len=a.rollout_max_response_len,
        rollout_num_gpus_per_engine=layout.rollout_tp_size,
        sglang_ep_size=layout.rollout_ep_size,
        sglang_max_running_requests=concurrency if full else 16,
        # K3's radix "extra_buffer" strategy needs five KDA cache slots per running request.
        sglang_max_mamba_cache_size=5 * concurrency if full else 16,
        sglang_cuda_graph_bs=[b for b in (1, 2, 4, 8, 16, 32) if b <= concurrency] if full else [1, 2, 4, 8, 16],
        sglang_context_length=8192 if a.mode == "debug_minimal" else None,
        sglang_mem_fraction_static=None if full else 0.7,
        sglang_max_lora_rank=a.lora_rank,
        model_variant=a.model_variant,
        hf_checkpoint=a.hf_checkpoint,
        sglang_path=a.sglang_path,
        num_gpus_per_node=a.num_gpus_per_node,
        seed=a.seed,
        rollout_max_response_len=a.rollout_max_response_len,
        sglang_max_total_tokens=a.sglang_max_total_tokens,
        check_weight_update_equal=a.check_weight_update_equal,
        lora_base_cpu_backup=a.lora_base_cpu_backup,
        rollout_max_concurrency=concurrency,
    )


def _data(a: TrainArgs) -> DataSettings:
    root = Path(a.data_dir)
    eval_on = a.eval_interval is not None
    if a.task == "gsm8k":
        # prepare-data writes jsonl beside the parquet files, so training never needs pyarrow
        return DataSettings(str(root / "gsm8k" / "train.jsonl"), "messages", "label", True,
                            "gsm8k" if eval_on else None, str(root / "gsm8k" / "test.jsonl") if eval_on else None,
                            "messages" if eval_on else None)
    if a.task == "arith":  # the smoke's generated task (`k3 prepare-data --task arith`), in the dapo-math format
        return DataSettings(str(root / "arith" / "train.jsonl"), "prompt", "label", True,
                            "arith" if eval_on else None, str(root / "arith" / "eval.jsonl") if eval_on else None,
                            "prompt" if eval_on else None)
    return DataSettings(str(root / "dapo-math-17k" / "dapo-math-17k.jsonl"), "prompt", "label", True,
                        "aime" if eval_on else None,
                        str(root / "aime-2024" / "aime-2024.jsonl") if eval_on else None,
                        "prompt" if eval_on else None)
