"""The recipe's perf settings reach the megatron trainer: ``use_dynamic_batch_size``, ``max_tokens_per_gpu`` and
``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` go from the resolved config through
``k3.rl.loop.worker_spec`` (``WorkerSpec``) and ``TrainerWorker`` into ``build_megatron_policy``, which checks the
recompute settings before it joins any process group."""

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
