"""The recipe's perf settings reach the megatron trainer: ``use_dynamic_batch_size``, ``max_tokens_per_gpu`` and
``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` go from the resolved config through
``k3.rl.loop.worker_spec`` (``WorkerSpec``) and ``TrainerWorker`` into ``build_megatron_policy``, which checks the
recompute settings before it joins any process group.

So do the optimizer's and the guards' (``use_distributed_optimizer``, ``optimizer_cpu_offload``,
``optimizer_offload_fraction``, ``check_for_nan_in_loss_and_grad``, ``distributed_timeout_minutes``,
``log_probs_chunk_size``), to either backend where it applies them; what megatron-core cannot run is refused at
parse time (the settings) and again before the trainer joins a process group. What they do is tested in
tests/parity/test_megatron_guards.py and tests/unit/test_log_probs_chunks.py."""

from __future__ import annotations

import dataclasses

import pytest

from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.rl import trainer_worker
from k3.rl.grpo import GRPOConfig
from k3.rl.loop import worker_spec


def _resolved(tmp_path, *extra):
    argv = ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--hf-checkpoint",
            str(tmp_path / "base"), "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), *extra]
    return resolve(parse_train_args(argv))


def test_worker_spec_carries_the_printed_perf_settings(tmp_path):
    r = _resolved(tmp_path, "--backend", "megatron")
    spec = worker_spec(r.settings)
    t = r.training
    assert (spec.use_dynamic_batch_size, spec.recompute_granularity, spec.recompute_method,
            spec.recompute_num_layers) == (t.use_dynamic_batch_size, t.recompute_granularity, t.recompute_method,
                                           t.recompute_num_layers) == (True, "full", "uniform", 1)
    printed = r.to_dict()
    assert (printed["use_dynamic_batch_size"], printed["recompute_granularity"], printed["recompute_method"],
            printed["recompute_num_layers"]) == (True, "full", "uniform", 1)


def test_trainer_worker_hands_them_to_the_megatron_policy(tmp_path, monkeypatch):
    seen = {}

    def fake_policy(model_dir, lora, pad_id, grpo, max_tokens, **kwargs):
        seen.update(kwargs, max_tokens=max_tokens)
        return object()

    class Tokenizer:
        pad_id = 0

    monkeypatch.setattr(trainer_worker, "build_megatron_policy", fake_policy)
    monkeypatch.setattr(trainer_worker, "load_tokenizer", lambda _: Tokenizer())
    r = _resolved(tmp_path, "--backend", "megatron", "--max-tokens-per-gpu", "4096")
    # --no-offload-train: the fake policy has no memory for the trainer's regions to manage
    spec = dataclasses.replace(worker_spec(r.settings), backend="megatron", offload_train=False)
    trainer_worker.TrainerWorker(spec, GRPOConfig(), r.args.max_tokens_per_gpu)
    assert seen["regions"] is None
    assert seen["max_tokens"] == 4096
    assert (seen["use_dynamic_batch_size"], seen["recompute_granularity"], seen["recompute_method"],
            seen["recompute_num_layers"]) == (True, "full", "uniform", 1)


@pytest.mark.parametrize("granularity, method, layers, match", [
    ("full", None, 1, "needs recompute_method"),
    ("selective", "uniform", 1, "to recompute_granularity 'full' only"),
    ("partial", None, None, "recompute_granularity='partial'"),
])
def test_bad_recompute_settings_stop_the_policy_before_it_starts(tmp_path, granularity, method, layers, match):
    from k3.lora import LoRAConfig
    from k3.rl.trainers.megatron import build_megatron_policy

    with pytest.raises(ValueError, match=match):
        build_megatron_policy(tmp_path / "nowhere", LoRAConfig(rank=4, alpha=8.0), pad_id=0,
                              recompute_granularity=granularity, recompute_method=method,
                              recompute_num_layers=layers)


# ---------------------------------------------------------------------------------------------- the optimizer and guards
GUARD_KEYS = ("use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction",
              "check_for_nan_in_loss_and_grad", "distributed_timeout_minutes", "log_probs_chunk_size")


def _spec_values(spec) -> tuple:
    return tuple(getattr(spec, k) for k in GUARD_KEYS)


def test_worker_spec_carries_the_printed_optimizer_and_guard_settings(tmp_path):
    # megatron on CPU (the tiny variant has no GPUs): the distributed optimizer, no offload (printed so, with a note)
    r = _resolved(tmp_path, "--backend", "megatron", "--distributed-timeout-minutes", "7")
    printed = r.to_dict()
    assert _spec_values(worker_spec(r.settings)) == tuple(printed[k] for k in GUARD_KEYS) == (
        True, False, 0.0, True, 7, 512)
    assert any("optimizer CPU offload is off" in n and "no GPUs" in n for n in r.notes)
    # with GPUs, the recipe's offload of 0.8; the 4layer variant runs without the NaN check (the recipe's)
    r = resolve(parse_train_args(["--mode", "normal", "--backend", "megatron", "--run-dir", str(tmp_path / "r4")]))
    printed = r.to_dict()
    assert _spec_values(worker_spec(r.settings)) == tuple(printed[k] for k in GUARD_KEYS) == (
        True, True, 0.8, False, 10, 512)
    # the torch backend: no megatron optimizer settings, the guards all the same
    r = _resolved(tmp_path)
    assert _spec_values(worker_spec(r.settings)) == (False, False, 0.0, True, 10, 512)


def test_trainer_worker_hands_the_guards_to_either_backend(tmp_path, monkeypatch):
    seen = {}

    class Tokenizer:
        pad_id = 0

    monkeypatch.setattr(trainer_worker, "build_megatron_policy", lambda *a, **kw: seen.update(megatron=kw))
    monkeypatch.setattr(trainer_worker, "PolicyTrainer", lambda *a, **kw: seen.update(torch=kw))
    monkeypatch.setattr(trainer_worker, "load_lora_model", lambda spec: None)
    monkeypatch.setattr(trainer_worker, "load_tokenizer", lambda _: Tokenizer())
    r = _resolved(tmp_path, "--backend", "megatron", "--distributed-timeout-minutes", "7")
    # offload_train off: the stand-in policies have no model to build memory regions around
    trainer_worker.TrainerWorker(dataclasses.replace(worker_spec(r.settings), backend="megatron", offload_train=False),
                                 GRPOConfig(), 64)
    assert tuple(seen["megatron"][k] for k in GUARD_KEYS) == (True, False, 0.0, True, 7, 512)
    r = _resolved(tmp_path)
    trainer_worker.TrainerWorker(dataclasses.replace(worker_spec(r.settings), offload_train=False), GRPOConfig(), 64,
                                 rank=0)
    assert (seen["torch"]["log_probs_chunk_size"], seen["torch"]["check_for_nan_in_loss_and_grad"],
            seen["torch"]["rank"]) == (512, True, 0)


@pytest.mark.parametrize("change", [{"use_distributed_optimizer": True}, {"optimizer_cpu_offload": True},
                                    {"optimizer_offload_fraction": 0.5}])
def test_the_torch_backend_refuses_the_megatron_optimizer_settings(tmp_path, monkeypatch, change):
    class Tokenizer:
        pad_id = 0

    monkeypatch.setattr(trainer_worker, "load_tokenizer", lambda _: Tokenizer())
    spec = dataclasses.replace(worker_spec(_resolved(tmp_path).settings), **change)
    key, value = next(iter(change.items()))
    with pytest.raises(ValueError, match=rf"{key}={value!r}: only the megatron backend applies these"):
        trainer_worker.TrainerWorker(spec, GRPOConfig(), 64)


@pytest.mark.parametrize("distributed, offload, fraction, match", [
    (True, False, 0.5, r"optimizer_offload_fraction=0.5 without optimizer_cpu_offload: nothing would be offloaded"),
    (False, True, 0.8, r"optimizer_cpu_offload needs use_distributed_optimizer"),
    (True, True, 1.5, r"optimizer_offload_fraction=1.5: expected a fraction in \[0, 1\]"),
    (True, True, float("nan"), r"optimizer_offload_fraction=nan: expected a fraction in \[0, 1\]"),
])
def test_optimizer_combinations_megatron_cannot_run_are_refused(tmp_path, distributed, offload, fraction, match):
    from k3.lora import LoRAConfig
    from k3.megatron.optimizer import OptimizerOptionError
    from k3.rl.trainers.megatron import build_megatron_policy
    from k3.settings.train import OptimizerSettings

    with pytest.raises(ValueError, match=match):  # the settings, at parse time
        OptimizerSettings("adam", 0.1, 0.9, 0.98, 0.0, "constant", distributed, offload, fraction)
    with pytest.raises(OptimizerOptionError, match=match):  # the trainer, before any process group
        build_megatron_policy(tmp_path / "nowhere", LoRAConfig(rank=4, alpha=8.0), pad_id=0,
                              use_distributed_optimizer=distributed, optimizer_cpu_offload=offload,
                              optimizer_offload_fraction=fraction)


def test_the_cpu_offload_without_cuda_is_refused_before_any_process_group(tmp_path, monkeypatch):
    import torch

    from k3.lora import LoRAConfig
    from k3.megatron.optimizer import OptimizerOptionError
    from k3.rl.trainers.megatron import build_megatron_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptimizerOptionError, match="optimizer_cpu_offload needs CUDA .* turn the offload off"):
        build_megatron_policy(tmp_path / "nowhere", LoRAConfig(rank=4, alpha=8.0), pad_id=0,
                              use_distributed_optimizer=True, optimizer_cpu_offload=True,
                              optimizer_offload_fraction=0.8)


@pytest.mark.parametrize("kwargs, match", [
    ({"log_probs_chunk_size": 0}, r"log_probs_chunk_size=0: expected tokens per chunk"),
    ({"distributed_timeout_minutes": 0}, r"distributed_timeout_minutes=0: expected a number of minutes > 0"),
    ({"distributed_timeout_minutes": float("inf")}, r"distributed_timeout_minutes=inf"),
])
def test_bad_chunk_sizes_and_timeouts_stop_the_policy_before_it_starts(tmp_path, kwargs, match):
    from k3.lora import LoRAConfig
    from k3.rl.trainers.megatron import build_megatron_policy

    with pytest.raises(ValueError, match=match):
        build_megatron_policy(tmp_path / "nowhere", LoRAConfig(rank=4, alpha=8.0), pad_id=0, **kwargs)
