"""`k3 train` flags: defaults per mode/task/variant, the parallel layout derivation, and every validation error
of the recipe launcher (miles-k3-recipe.md §6.1), each checked for a message that says what to change."""

from __future__ import annotations

import dataclasses
import re

import pytest

from k3.launch.args import (
    LaunchConfigError,
    TrainArgs,
    resolve,
)
from k3.launch.layout import LayoutError, split_pipeline_layers
from k3.launch.parser import build_parser, env_var_name, flag_name, parse_train_args
from k3.settings.lora import target_names

GIB = 1024**3

# The recipe page §4 launch (paths as placeholders).
VALIDATED_LAUNCH = (
    "--mode normal --model-variant full --task dapo-math --reward-model deepscaler "
    "--num-nodes 16 --num-gpus-per-node 4 --pipeline-parallel-size 8 --context-parallel-size 2 "
    "--rollout-tp-size 16 --rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64 "
    "--num-rollout 1000 --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 4096 "
    "--sglang-max-total-tokens 65536 --global-batch-size 64 --lr 1e-05 --eval-interval 10 "
    "--distributed-timeout-minutes 60 --hf-checkpoint /models/native --ref-load /models/dcp "
    "--sglang-path /sgl-workspace/sglang/python --data-dir /datasets --enable-wandb --run-id validated"
).split()


def parse(words: str | list[str], environ: dict[str, str] | None = None) -> TrainArgs:
    argv = words.split() if isinstance(words, str) else words
    return parse_train_args(argv, environ={} if environ is None else environ)


def full(**changes) -> TrainArgs:
    """The full variant on its 16×4 cluster, everything else at the defaults."""
    base = dict(model_variant="full", num_nodes=16, num_gpus_per_node=4, run_id="t")
    base.update(changes)
    return TrainArgs(**base)


def error_of(args: TrainArgs) -> str:
    with pytest.raises(LaunchConfigError) as e:
        resolve(args)
    return str(e.value)


# --------------------------------------------------------------------------- the validated launch
def test_validated_launch_resolves_to_the_recipe_layout():
    r = resolve(parse(VALIDATED_LAUNCH))
    lay = r.layout
    assert (lay.tensor_model_parallel_size, lay.context_parallel_size, lay.pipeline_model_parallel_size,
            lay.data_parallel_size, lay.expert_model_parallel_size, lay.expert_tensor_parallel_size) == (4, 2, 8, 1,
                                                                                                         8, 1)
    assert lay.world_size == 64 and lay.sequence_parallel is True
    assert lay.pipeline_layers == (12,) * 7 + (9,)
    assert (lay.decoder_first_pipeline_num_layers, lay.decoder_last_pipeline_num_layers) == (12, 9)
    assert (lay.num_rollout_engines, lay.rollout_tp_size, lay.rollout_ep_size) == (4, 16, 1)
    a = r.args
    assert a.max_tokens_per_gpu == 8192
    assert a.colocate_memory_peak_device == "gpu" and a.lora_base_cpu_backup is True
    assert (a.lora_rank, a.lora_alpha, a.lr, a.eval_interval) == (32, 64, 1e-5, 10)
    assert (a.hf_checkpoint, a.ref_load) == ("/models/native", "/models/dcp")
    assert r.training.num_steps_per_rollout == 1  # 8 prompts × 8 samples = one global batch of 64
    assert (r.optimizer.optimizer, r.optimizer.weight_decay, r.optimizer.adam_beta2) == ("adam", 0.1, 0.98)
    assert r.rollout.sglang_max_running_requests == 8 and r.rollout.sglang_max_mamba_cache_size == 40
    assert r.rollout.sglang_cuda_graph_bs == [1, 2, 4, 8]
    assert (r.data.eval_dataset_name, r.data.eval_prompt_data) == ("aime", "/datasets/aime-2024/aime-2024.jsonl")
    assert r.data.prompt_data == "/datasets/dapo-math-17k/dapo-math-17k.jsonl" and r.data.input_key == "prompt"
    assert r.training.save == "runs/validated/adapters"  # where k3.rl.resume writes the adapter checkpoints


@pytest.mark.parametrize(
    "pp, cp, tp, ep, dp",
    [(1, 1, 32, 64, 2), (8, 1, 8, 8, 1), (8, 2, 4, 8, 1)],  # the recipe's tested layouts
)
def test_recipe_tested_layouts(pp, cp, tp, ep, dp):
    lay = resolve(full(pipeline_parallel_size=pp, context_parallel_size=cp)).layout
    assert (lay.tensor_model_parallel_size, lay.expert_model_parallel_size, lay.data_parallel_size) == (tp, ep, dp)


@pytest.mark.parametrize("pp, cp", [(1, 2), (2, 1), (2, 4), (4, 2), (8, 4), (8, 8), (16, 1), (16, 4)])
def test_derivation_closed_form(pp, cp):
    lay = resolve(full(pipeline_parallel_size=pp, context_parallel_size=cp)).layout
    tp = 32 if pp == 1 else 64 // (pp * cp)
    assert lay.tensor_model_parallel_size == tp
    assert lay.data_parallel_size == 64 // (tp * cp * pp)
    assert lay.expert_model_parallel_size == tp * cp * lay.data_parallel_size == 64 // pp
    assert lay.expert_tensor_parallel_size == 1
    assert sum(lay.pipeline_layers) == 93 and len(lay.pipeline_layers) == pp


def test_overrides_replace_the_derivation():
    lay = resolve(full(pipeline_parallel_size=8, tp_size_override=4)).layout
    assert (lay.tensor_model_parallel_size, lay.data_parallel_size, lay.expert_model_parallel_size) == (4, 2, 8)
    lay = resolve(full(pipeline_parallel_size=8, ep_size_override=4)).layout
    assert (lay.tensor_model_parallel_size, lay.expert_model_parallel_size) == (8, 4)


@pytest.mark.parametrize(
    "layers, pp, split",
    [(93, 1, [93]), (93, 2, [47, 46]), (93, 4, [24, 24, 24, 21]), (93, 8, [12] * 7 + [9]),
     (93, 16, [6] * 15 + [3]), (4, 1, [4]), (9, 3, [3, 3, 3])],
)
def test_pipeline_split(layers, pp, split):
    assert split_pipeline_layers(layers, pp) == split


def test_pipeline_split_rejects_an_empty_last_stage():
    with pytest.raises(LayoutError, match=r"cannot split 93 layers: 3 layers on each of the first 31 stages leave 0"):
        split_pipeline_layers(93, 32)


def test_even_split_passes_no_first_last_sizes():
    lay = resolve(TrainArgs(run_id="t")).layout  # 4layer, one stage
    assert lay.pipeline_layers == (4,)
    assert lay.decoder_first_pipeline_num_layers is None and lay.decoder_last_pipeline_num_layers is None


def test_4layer_and_tiny_layouts():
    lay = resolve(TrainArgs(run_id="t")).layout
    assert (lay.world_size, lay.tensor_model_parallel_size, lay.expert_model_parallel_size,
            lay.pipeline_model_parallel_size, lay.data_parallel_size) == (8, 8, 8, 1, 1)
    assert (lay.num_rollout_engines, lay.rollout_tp_size, lay.rollout_ep_size) == (1, 8, 8)
    r = resolve(TrainArgs(model_variant="tiny", run_id="t"))
    lay = r.layout
    assert r.args.num_gpus_per_node == 0 and not r.uses_gpus
    assert (lay.world_size, lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size,
            lay.context_parallel_size, lay.data_parallel_size, lay.expert_model_parallel_size,
            lay.expert_tensor_parallel_size, lay.num_rollout_engines, lay.rollout_tp_size) == (1,) * 9
    assert lay.sequence_parallel is False and lay.pipeline_layers == (9,)
    assert resolve(TrainArgs(model_variant="tiny", num_gpus_per_node=1, run_id="t")).layout.world_size == 1


# --------------------------------------------------------------------------- defaults per mode / task / variant
@pytest.mark.parametrize(
    "mode, task, expected",
    [
        ("debug_minimal", "gsm8k", dict(num_rollout=2, rollout_batch_size=8, n_samples_per_prompt=2,
                                        rollout_max_response_len=256, global_batch_size=16, reward_model="math")),
        ("debug_minimal", "dapo-math", dict(num_rollout=2, rollout_batch_size=8, n_samples_per_prompt=2,
                                            rollout_max_response_len=32, global_batch_size=16,
                                            reward_model="deterministic_random")),
        ("normal", "gsm8k", dict(num_rollout=3000, rollout_batch_size=32, n_samples_per_prompt=8,
                                 rollout_max_response_len=256, global_batch_size=256, reward_model="math")),
        ("normal", "dapo-math", dict(num_rollout=3000, rollout_batch_size=32, n_samples_per_prompt=8,
                                     rollout_max_response_len=16384, global_batch_size=256,
                                     reward_model="deepscaler")),
    ],
)
def test_mode_and_task_defaults(mode, task, expected):
    r = resolve(TrainArgs(mode=mode, task=task, run_id="t"))
    assert {k: getattr(r.args, k) for k in expected} == expected
    assert r.rollout.eval_max_response_len == expected["rollout_max_response_len"]
    assert r.training.num_steps_per_rollout == 1


def test_mode_optimizer_and_memory_margin():
    debug = resolve(TrainArgs(run_id="t"))
    assert debug.args.lr == 1e-6
    # The recipe's debug_minimal runs SGD at momentum 0 (both trainers build it: tests/unit/test_sgd_optimizer.py).
    assert (debug.optimizer.optimizer, debug.optimizer.sgd_momentum, debug.optimizer.weight_decay,
            debug.optimizer.lr_decay_style) == ("sgd", 0.0, 0.0, "constant")
    assert debug.colocate.train_memory_margin_bytes == 2 * GIB
    assert debug.rollout.sglang_context_length == 8192
    normal = resolve(TrainArgs(mode="normal", run_id="t"))
    assert normal.args.lr == 1e-5
    assert (normal.optimizer.optimizer, normal.optimizer.weight_decay, normal.optimizer.adam_beta1,
            normal.optimizer.adam_beta2) == ("adam", 0.1, 0.9, 0.98)
    assert normal.colocate.train_memory_margin_bytes == 4 * GIB
    assert normal.rollout.sglang_context_length is None
    # The recipe's Megatron optimizer offload only exists on the megatron backend.
    assert (normal.optimizer.optimizer_cpu_offload, normal.optimizer.optimizer_offload_fraction) == (False, 0.0)
    mega = resolve(TrainArgs(mode="normal", backend="megatron", run_id="t")).optimizer
    assert (mega.optimizer_cpu_offload, mega.optimizer_offload_fraction, mega.use_distributed_optimizer) == (
        True, 0.8, True)


def test_grpo_is_the_recipes():
    g = resolve(TrainArgs(run_id="t")).grpo
    assert (g.advantage_estimator, g.eps_clip, g.eps_clip_high, g.kl_loss_coef, g.entropy_coef, g.grpo_std_eps) == (
        "grpo", 0.2, 0.28, 0.0, 0.0, 1e-6)


def test_debug_lr_flag_is_noted_not_silently_dropped():
    r = resolve(TrainArgs(lr=3e-5, run_id="t"))
    assert r.args.lr == 1e-6
    assert r.notes == ("--lr 3e-05 is ignored in --mode debug_minimal (lr 1e-6); use --mode normal",)
    assert resolve(TrainArgs(run_id="t")).notes == ()


def test_variant_defaults():
    four = resolve(TrainArgs(run_id="t")).args
    assert (four.max_tokens_per_gpu, four.num_gpus_per_node) == (512, 8)
    assert four.hf_checkpoint == "/root/models/Kimi-K3-4layer-bf16"
    big = resolve(full()).args
    assert big.max_tokens_per_gpu == 8192
    assert (big.hf_checkpoint, big.ref_load) == ("/root/models/Kimi-K3/native", "/root/models/Kimi-K3/torch_dist")
    tiny = resolve(TrainArgs(model_variant="tiny", run_id="t")).args
    assert (tiny.max_tokens_per_gpu, tiny.hf_checkpoint, tiny.ref_load) == (512, None, None)
    assert resolve(TrainArgs(model_variant="tiny", hf_checkpoint="/c", run_id="t")).args.hf_checkpoint == "/c"
    assert resolve(TrainArgs(max_tokens_per_gpu=2048, run_id="t")).args.max_tokens_per_gpu == 2048


def test_4layer_rollout_sizing():
    r = resolve(TrainArgs(run_id="t")).rollout
    assert (r.rollout_num_gpus_per_engine, r.sglang_ep_size, r.sglang_max_running_requests,
            r.sglang_max_mamba_cache_size, r.sglang_cuda_graph_bs, r.sglang_mem_fraction_static) == (
        8, 8, 16, 16, [1, 2, 4, 8, 16], 0.7)
    assert (r.rollout_temperature, r.eval_temperature, r.n_samples_per_eval_prompt) == (1.0, 0.0, 1)


def test_gsm8k_data_and_default_run_dir():
    r = resolve(TrainArgs(run_id="abc", data_dir="/d", eval_interval=5))
    assert (r.data.prompt_data, r.data.input_key, r.data.eval_dataset_name, r.data.eval_prompt_data) == (
        "/d/gsm8k/train.jsonl", "messages", "gsm8k", "/d/gsm8k/test.jsonl")
    assert r.args.run_dir == "runs/abc"
    no_eval = resolve(TrainArgs(run_id="abc")).data
    assert no_eval.eval_dataset_name is None and no_eval.eval_prompt_data is None


def test_generated_run_id_and_input_untouched():
    args = TrainArgs()
    r = resolve(args)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", r.args.run_id)
    assert args.run_id is None and args.num_rollout is None and args.num_gpus_per_node is None


def test_worker_env():
    r = resolve(TrainArgs(run_id="t", extra_env_vars="A=1 B='x y'", cuda_core_dump=True, output_dir="/o"))
    assert r.env["A"] == "1" and r.env["B"] == "x y" and r.env["NCCL_TIMEOUT"] == "3600"
    assert r.env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert r.env["CUDA_COREDUMP_FILE"] == "/o/cuda_coredump_%h.%p.%t"
    assert "SGLANG_JIT_ROUTE_RADIX" not in r.env
    sg = resolve(TrainArgs(run_id="t", rollout_engine="sglang", sglang_path="/sgl")).env
    assert sg["SGLANG_JIT_ROUTE_RADIX"] == "1" and "/sgl" in sg["PYTHONPATH"].split(":")
    tiny = resolve(TrainArgs(model_variant="tiny", run_id="t")).env
    assert "NCCL_TIMEOUT" not in tiny


# --------------------------------------------------------------------------- validation: what to change
@pytest.mark.parametrize(
    "args, message",
    [
        (full(num_nodes=2, num_gpus_per_node=8),
         "--model-variant full requires --num-nodes 16 --num-gpus-per-node 4 (got 2×8)"),
        (TrainArgs(num_nodes=2), "--model-variant 4layer requires --num-nodes 1 --num-gpus-per-node 8 (got 2×8)"),
        (TrainArgs(pipeline_parallel_size=2),
         "--model-variant 4layer requires --pipeline-parallel-size 1 (got 2): its 4 layers run on one stage"),
        (TrainArgs(model_variant="tiny", num_gpus_per_node=2),
         "--model-variant tiny runs as one process: use --num-nodes 1 and --num-gpus-per-node 0 (CPU) or 1 "
         "(got 1×2)"),
        (TrainArgs(model_variant="tiny", pipeline_parallel_size=2),
         "--model-variant tiny runs as one process: --pipeline-parallel-size must be 1 (got 2)"),
        (full(pipeline_parallel_size=3), "--pipeline-parallel-size 3 does not divide 64 GPUs: use 1, 2, 4, 8 or 16"),
        (full(pipeline_parallel_size=32),
         "--pipeline-parallel-size 32 cannot split 93 layers: 3 layers on each of the first 31 stages leave 0 for "
         "the last one; use 1, 2, 4, 8 or 16"),
        (full(pipeline_parallel_size=0), "--pipeline-parallel-size 0: must be >= 1"),
        (full(pipeline_parallel_size=8, context_parallel_size=3),
         "--context-parallel-size 3 does not fit 64 GPUs with --pipeline-parallel-size 8 (PP × CP must divide 64): "
         "use 1, 2, 4 or 8"),
        (full(context_parallel_size=4),
         "--context-parallel-size 4 with --pipeline-parallel-size 1 needs TP 32 × CP 4 × PP 1 = 128 GPUs, more than "
         "64: use --context-parallel-size 1 or 2 (or set --tp-size-override)"),
        (full(pipeline_parallel_size=8, tp_size_override=3),
         "--tp-size-override 3 must divide the 96 attention heads and the 8 ranks left by PP 8 × CP 1 on 64 GPUs: "
         "use 1, 2, 4 or 8"),
        (full(pipeline_parallel_size=8, ep_size_override=3),
         "--ep-size-override 3 must divide the 896 experts and the 8 ranks of a pipeline stage (64 GPUs / PP 8): "
         "use 1, 2, 4 or 8"),
        (full(rollout_tp_size=12),
         "--rollout-tp-size 12 must divide 64 (GPUs) and 96 (attention heads): use 1, 2, 4, 8, 16 or 32"),
        (full(rollout_tp_size=16, rollout_ep_size=3),
         "--rollout-ep-size 3 must divide --rollout-tp-size 16 and the 896 experts: use 1, 2, 4, 8 or 16"),
        (TrainArgs(rollout_tp_size=4),
         "--rollout-tp-size applies to --model-variant full only; 4layer rollout engines are TP8/EP8 "
         "(drop --rollout-tp-size 4)"),
        (TrainArgs(lora_rank=0), "--lora-rank 0: must be > 0"),
        (TrainArgs(lora_dropout=1.0), "--lora-dropout 1.0: must be in [0, 1)"),
        (TrainArgs(sglang_max_total_tokens=0), "--sglang-max-total-tokens 0: must be > 0"),
        (TrainArgs(num_rollout=0), "--num-rollout 0: must be > 0"),
        (TrainArgs(target_modules=["self_attention.o_proj", "foo"]),
         "--target-modules: unknown foo; allowed: " + " ".join(target_names())),
        (TrainArgs(target_modules=list(target_names()[1:])),
         "--target-modules must include self_attention.o_proj (only mlp.experts.linear_fc2 may be left out)"),
        (TrainArgs(experts_shared_outer_loras=False),
         "--no-experts-shared-outer-loras is not supported: K3's 896-expert adapters share their outer factors; "
         "drop the flag"),
        (TrainArgs(offload_rollout_level=["kv_cache"]),
         "--lora-base-cpu-backup needs 'weight' in --offload-rollout-level (got kv_cache): add weight, or pass "
         "--no-lora-base-cpu-backup"),
        (TrainArgs(model_variant="tiny", rollout_engine="sglang"),
         "--rollout-engine sglang needs GPUs (--num-gpus-per-node 0 is CPU): use --rollout-engine embedded on CPU"),
        (TrainArgs(global_batch_size=48, rollout_batch_size=8, n_samples_per_prompt=8),
         "--rollout-batch-size 8 × --n-samples-per-prompt 8 = 64 samples per rollout is not a multiple of "
         "--global-batch-size 48: use a global batch that divides 64 (e.g. 64, 32, 16)"),
        (full(rollout_batch_size=15, n_samples_per_prompt=1, global_batch_size=15),
         "--global-batch-size 15 must be a multiple of the data-parallel size 2"),
        (TrainArgs(extra_env_vars="A=1 oops"),
         "--extra-env-vars: 'oops' is not KEY=VALUE (pairs are space-separated)"),
        (TrainArgs(expert_lora_kernel="cuda"), "--expert-lora-kernel 'cuda': expected one of auto, torch, triton"),
        (TrainArgs(mode="fast"), "--mode 'fast': expected one of debug_minimal, normal"),
        (TrainArgs(reward_model="exact"), "--reward-model 'exact': expected one of deterministic_random, deepscaler, "
                                          "math"),
    ],
)
def test_validation_errors_say_what_to_change(args, message):
    assert error_of(dataclasses.replace(args, run_id="t")) == message


def test_dropping_only_the_optional_expert_fc2_target_is_allowed():
    kept = [m for m in target_names() if m != "mlp.experts.linear_fc2"]
    assert resolve(TrainArgs(target_modules=kept, run_id="t")).args.target_modules == kept


def test_lora_base_cpu_backup_off_needs_no_weight_release():
    r = resolve(TrainArgs(offload_rollout_level=["kv_cache"], lora_base_cpu_backup=False, run_id="t"))
    assert r.args.lora_base_cpu_backup is False


# --------------------------------------------------------------------------- the command line
def test_parser_reads_the_validated_launch_exactly():
    a = parse(VALIDATED_LAUNCH)
    assert (a.mode, a.model_variant, a.task, a.reward_model, a.num_nodes, a.num_gpus_per_node) == (
        "normal", "full", "dapo-math", "deepscaler", 16, 4)
    assert (a.rollout_max_concurrency, a.sglang_max_total_tokens, a.lr, a.enable_wandb) == (8, 65536, 1e-5, True)


def test_parser_defaults_equal_the_dataclass():
    a = parse([])
    assert a == TrainArgs(num_nodes=a.num_nodes)


def test_bool_and_list_flags():
    a = parse("--no-lora-base-cpu-backup --external-ray --offload-rollout-level kv_cache")
    assert (a.lora_base_cpu_backup, a.external_ray, a.offload_rollout_level) == (False, True, ["kv_cache"])


def test_env_binding_and_command_line_precedence():
    environ = {"K3_NUM_NODES": "16", "K3_EXTERNAL_RAY": "1", "K3_LORA_RANK": "8", "K3_HF_CHECKPOINT": "/ckpt",
               "K3_TARGET_MODULES": "self_attention.o_proj,mlp.linear_fc1", "K3_EVAL_INTERVAL": "none"}
    a = parse("--lora-rank 32", environ)
    assert (a.num_nodes, a.external_ray, a.lora_rank, a.hf_checkpoint) == (16, True, 32, "/ckpt")
    assert a.target_modules == ["self_attention.o_proj", "mlp.linear_fc1"] and a.eval_interval is None


@pytest.mark.parametrize("var, value, message", [
    ("K3_NUM_NODES", "many", "K3_NUM_NODES='many': not an integer for --num-nodes"),
    ("K3_RESUME", "maybe", "K3_RESUME='maybe': not a boolean for --resume (expected one of"),
    ("K3_LR", "fast", "K3_LR='fast': not a finite number for --lr"),
])
def test_bad_env_value_names_the_variable(var, value, message):
    with pytest.raises(LaunchConfigError, match=re.escape(message)):
        parse([], {var: value})


def test_slurm_node_count_is_the_default(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "16")
    assert TrainArgs().num_nodes == 16
    monkeypatch.delenv("SLURM_JOB_NUM_NODES")
    assert TrainArgs().num_nodes == 1


def test_unknown_flag_and_bad_choice_exit_2(capsys):
    for argv in (["--no-such-flag"], ["--model-variant", "huge"]):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_help_lists_every_flag_with_default_and_variable():
    text = " ".join(build_parser({}).format_help().split())  # undo line wrapping
    for f in dataclasses.fields(TrainArgs):
        assert flag_name(f.name) in text and env_var_name(f.name) in text, f.name
    assert "--lora-rank N LoRA rank r (> 0) [default: 16; env K3_LORA_RANK]" in text
    assert "--lora-base-cpu-backup, --no-lora-base-cpu-backup" in text
    assert "[default: gpu; env K3_COLOCATE_MEMORY_PEAK_DEVICE]" in text


def test_expert_lora_kernel_choices_are_the_kernel_modules():
    """k3.settings.train keeps its own copy (kernels are leaves, and the settings must not load torch and Triton
    just to parse flags): they may not drift."""
    from k3.kernels.expert_lora.function import KERNEL_CHOICES
    from k3.settings.train import EXPERT_LORA_KERNELS

    assert EXPERT_LORA_KERNELS == KERNEL_CHOICES
