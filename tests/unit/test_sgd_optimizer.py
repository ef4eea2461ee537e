"""The recipe's debug_minimal optimizer, SGD, on the torch backend and in the settings (the megatron backend's:
tests/parity/test_megatron_sgd.py).

- ``build_optimizer`` with ``GRPOConfig(optimizer="sgd")``: torch's SGD; one step is ``p − lr·(g + wd·p)`` (1-D
  parameters undecayed), two with momentum ``m`` are ``p1 = p0 − lr·g0``, ``p2 = p1 − lr·(m·g0 + g1)``; at momentum
  0 it holds no state. ``PolicyTrainer`` steps the same closed form on K3's adapters.
- The trainer worker's optimizer state (torch backend) says which optimizer wrote it; a resume with the other is
  refused in one line, and keeps the run's lr and momentum over the saved ones; an untagged state is Adam's.
- ``--mode debug_minimal`` resolves to SGD at momentum 0 (both backends; the distributed optimizer on megatron) and
  prints ``optimizer sgd`` / ``sgd_momentum 0.0`` with the Adam betas off; normal resolves to Adam with
  ``sgd_momentum`` off. A bad optimizer name or momentum is refused, and so is SGD with the CPU offload.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_lora_model import tiny_lora_model
from torch import nn

from k3.launch.args import TrainArgs, resolve
from k3.rl.grpo import GRPOConfig, build_optimizer, load_torch_optimizer_state, optimizer_kind
from k3.settings.train import OptimizerSettings, optimizer_options_problem

LR, WD, M = 0.1, 0.01, 0.9


def _params() -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [("x.lora_A.weight", nn.Parameter(torch.randn(3, 4, generator=gen, dtype=torch.float64))),
            ("x.lora_magnitude", nn.Parameter(torch.randn(4, generator=gen, dtype=torch.float64)))]


def _step(opt, params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for _, p in params]
    for (_, p), g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return grads


# ---------------------------------------------------------------------------------------------- build_optimizer
def test_one_sgd_step_is_p_minus_lr_g_with_l2_decay_on_matrices_only():
    params = _params()
    opt = build_optimizer(params, GRPOConfig(optimizer="sgd", lr=LR, weight_decay=WD))
    assert type(opt) is torch.optim.SGD and optimizer_kind(opt) == "sgd"
    assert [(g["lr"], g["momentum"], g["weight_decay"], g["dampening"], g["nesterov"]) for g in opt.param_groups] \
        == [(LR, 0.0, WD, 0, False), (LR, 0.0, 0.0, 0, False)]
    p0 = [p.detach().clone() for _, p in params]
    g = _step(opt, params, 1)
    torch.testing.assert_close(params[0][1].detach(), p0[0] - LR * (g[0] + WD * p0[0]), rtol=0, atol=1e-15)
    torch.testing.assert_close(params[1][1].detach(), p0[1] - LR * g[1], rtol=0, atol=1e-15)
    assert len(opt.state) == 0  # momentum 0: no momentum buffer, no state at all


def test_two_sgd_steps_with_momentum_are_the_closed_form():
    params = _params()
    opt = build_optimizer(params, GRPOConfig(optimizer="sgd", lr=LR, weight_decay=0.0, sgd_momentum=M))
    p0 = [p.detach().clone() for _, p in params]
    g0 = _step(opt, params, 1)
    p1 = [p.detach().clone() for _, p in params]
    g1 = _step(opt, params, 2)
    for k, (_, p) in enumerate(params):
        torch.testing.assert_close(p1[k], p0[k] - LR * g0[k], rtol=0, atol=1e-15)
        torch.testing.assert_close(p.detach(), p1[k] - LR * (M * g0[k] + g1[k]), rtol=0, atol=1e-15)
    assert len(opt.state) == 2


def test_adam_stays_the_default():
    opt = build_optimizer(_params())
    assert type(opt) is torch.optim.AdamW and optimizer_kind(opt) == "adam"


@pytest.mark.parametrize("kwargs, says", [
    ({"optimizer": "rmsprop"}, "optimizer='rmsprop': expected one of adam, sgd"),
    ({"optimizer": "SGD"}, "optimizer='SGD': expected one of adam, sgd"),
    ({"optimizer": "sgd", "sgd_momentum": -0.1}, r"sgd_momentum=-0.1: expected a momentum factor in \[0, 1\)"),
    ({"optimizer": "sgd", "sgd_momentum": 1.0}, r"sgd_momentum=1.0: expected a momentum factor in \[0, 1\)"),
    ({"optimizer": "sgd", "sgd_momentum": math.nan}, r"sgd_momentum=nan: expected a momentum factor"),
])
def test_a_bad_optimizer_or_momentum_is_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        GRPOConfig(**kwargs)
    name, momentum = kwargs["optimizer"], kwargs.get("sgd_momentum", 0.0)
    with pytest.raises(ValueError, match=says):  # the run's settings, at parse time
        OptimizerSettings(name, 0.0, 0.9, 0.98, momentum, "constant", False, False, 0.0)


def test_sgd_with_the_cpu_offload_is_refused():
    says = optimizer_options_problem(True, True, 0.8, "sgd", 0.0)
    assert says.startswith("optimizer_cpu_offload with optimizer='sgd': the offload is wired") and "\n" not in says
    assert optimizer_options_problem(True, True, 0.8, "adam", 0.0) is None
    with pytest.raises(ValueError, match="optimizer_cpu_offload with optimizer='sgd'"):
        OptimizerSettings("sgd", 0.0, 0.9, 0.98, 0.0, "constant", True, True, 0.8)


def test_the_megatron_policy_refuses_sgd_with_the_offload_before_any_process_group(tmp_path):
    from k3.lora import LoRAConfig
    from k3.megatron.optimizer import OptimizerOptionError
    from k3.rl.trainers.megatron import build_megatron_policy

    with pytest.raises(OptimizerOptionError, match="optimizer_cpu_offload with optimizer='sgd'"):
        build_megatron_policy(tmp_path / "nowhere", LoRAConfig(rank=4, alpha=8.0), pad_id=0,
                              grpo=GRPOConfig(optimizer="sgd"), use_distributed_optimizer=True,
                              optimizer_cpu_offload=True, optimizer_offload_fraction=0.8)


# ---------------------------------------------------------------------------------------------- the torch trainer
def test_policy_trainer_steps_sgd_by_the_closed_form():
    from k3.rl.trainers.torch import PolicyTrainer
    from k3.rl.trainers.trajectory import Trajectory

    trainer = PolicyTrainer(tiny_lora_model(), pad_id=0, max_tokens_per_micro_batch=16,
                            grpo=GRPOConfig(optimizer="sgd", lr=LR, weight_decay=0.0, sgd_momentum=M))
    gen = torch.Generator().manual_seed(5)
    trajs = []
    for k, adv in enumerate((1.0, -0.5, 0.7, -1.2)):
        n_prompt, n_response = 2 + k % 3, 2 + (3 * k) % 5
        ids = torch.randint(3, trainer.model.config.vocab_size, (n_prompt + n_response,), generator=gen).tolist()
        trajs.append(Trajectory(ids[:n_prompt], ids[n_prompt:], adv))
    for t, lp in zip(trajs, trainer.log_probs(trajs)):
        t.old_log_probs = [x - 0.05 for x in lp]  # a ratio off 1
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    p0 = {n: p.detach().clone() for n, p in named}
    trainer.train_step(trajs)
    g0 = {n: p.grad.detach().clone() for n, p in named}  # the clipped gradient the step used
    p1 = {n: p.detach().clone() for n, p in named}
    trainer.train_step(trajs)
    g1 = {n: p.grad.detach().clone() for n, p in named}
    moved = 0.0
    for n, p in named:
        torch.testing.assert_close(p1[n], p0[n] - LR * g0[n], rtol=0, atol=1e-7)
        torch.testing.assert_close(p.detach(), p1[n] - LR * (M * g0[n] + g1[n]), rtol=0, atol=1e-7)
        moved = max(moved, (p1[n] - p0[n]).abs().max().item())
    assert moved > 1e-4


# ---------------------------------------------------------------------------------------------- resume
def _worker(optimizer: str, lr: float = LR, momentum: float = 0.0):
    """A torch-backend TrainerWorker holding just an optimizer over two parameters (what its state methods use)."""
    from k3.rl.trainer_worker import TrainerWorker

    class Policy:
        pass

    policy = Policy()
    policy.params = _params()
    policy.optimizer = build_optimizer(policy.params, GRPOConfig(optimizer=optimizer, lr=lr, weight_decay=0.0,
                                                                 sgd_momentum=momentum))
    policy.steps = 0
    worker = TrainerWorker.__new__(TrainerWorker)
    worker._megatron, worker.policy, worker.memory = False, policy, None  # no --offload-train regions
    return worker


def _stepped(worker, seed: int = 1):
    _step(worker.policy.optimizer, worker.policy.params, seed)
    worker.policy.steps += 1
    return worker


def test_a_resumed_sgd_state_continues_bit_for_bit_and_keeps_the_runs_lr_and_momentum(tmp_path):
    saved = _stepped(_worker("sgd", momentum=M))
    state = saved.optimizer_state()
    assert (state["optimizer_kind"], state["backend"], state["steps"]) == ("sgd", "torch", 1)
    torch.save(state, tmp_path / "state.pt")
    resumed = _worker("sgd", momentum=M)
    with torch.no_grad():
        for (_, p), (_, q) in zip(resumed.policy.params, saved.policy.params):
            p.copy_(q)
    resumed.load_optimizer_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.policy.steps == 1
    _stepped(saved, 2), _stepped(resumed, 2)
    for (_, p), (_, q) in zip(resumed.policy.params, saved.policy.params):
        assert torch.equal(p, q)  # the momentum buffers came back
    other = _worker("sgd", lr=2 * LR, momentum=0.5)
    other.load_optimizer_state(torch.load(tmp_path / "state.pt", weights_only=True))
    assert {(g["lr"], g["momentum"]) for g in other.policy.optimizer.param_groups} == {(2 * LR, 0.5)}
    assert len(other.policy.optimizer.state) == 2  # the buffers are loaded all the same


@pytest.mark.parametrize("saved, run", [("adam", "sgd"), ("sgd", "adam")])
def test_a_state_of_the_other_optimizer_is_refused_in_one_line(saved, run):
    state = _stepped(_worker(saved)).optimizer_state()
    resumed = _worker(run)
    before = resumed.policy.optimizer.state_dict()
    with pytest.raises(ValueError) as err:
        resumed.load_optimizer_state(state)
    assert str(err.value) == (f"the optimizer state was saved by {saved}; this run trains with {run}: resume in the "
                              "--mode that saved it (debug_minimal: sgd, normal: adam), or start a new run")
    assert resumed.policy.optimizer.state_dict() == before and resumed.policy.steps == 0  # nothing loaded


def test_an_untagged_state_is_adams():
    state = _stepped(_worker("adam")).optimizer_state()
    state.pop("optimizer_kind")
    _worker("adam").load_optimizer_state(state)
    with pytest.raises(ValueError, match="saved by adam; this run trains with sgd"):
        _worker("sgd").load_optimizer_state(state)


@pytest.mark.parametrize("state, kind", [
    ({"optimizer": {}, "steps": 1}, "adam"),
    ({"optimizer": {}, "steps": 1, "optimizer_kind": "sgd"}, "sgd"),
    ({"world_size": 2, "ranks": [{"optimizer_kind": "sgd"}, {"optimizer_kind": "sgd"}]}, "sgd"),
])
def test_a_checkpoints_optimizer_is_read_from_its_first_rank(state, kind):
    from k3.rl.resume import saved_optimizer_kind

    assert saved_optimizer_kind(state) == kind


def test_a_state_with_an_unknown_optimizer_tag_is_malformed():
    from k3.rl.resume import trainer_state_problem

    state = {"rollout_id": 0, "version": 1, "optimizer": {}, "steps": 1, "optimizer_kind": "rmsprop"}
    assert trainer_state_problem(state) == "'optimizer_kind' is 'rmsprop', not one of adam, sgd"


def test_load_torch_optimizer_state_refuses_before_it_loads():
    opt = build_optimizer(_params(), GRPOConfig(optimizer="sgd"))
    with pytest.raises(ValueError, match="saved by adam"):
        load_torch_optimizer_state(opt, {"state": {}, "param_groups": []}, "adam")


# ---------------------------------------------------------------------------------------------- the launcher
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_debug_minimal_resolves_to_sgd_and_prints_it(backend):
    r = resolve(TrainArgs(model_variant="tiny", run_id="t", backend=backend))
    o = r.optimizer
    assert (o.optimizer, o.sgd_momentum, o.weight_decay, o.lr, o.lr_decay_style) == ("sgd", 0.0, 0.0, 1e-6,
                                                                                        "constant")
    assert o.use_distributed_optimizer is (backend == "megatron")  # the recipe's debug_minimal on megatron
    printed = r.to_dict()
    assert (printed["optimizer"], printed["sgd_momentum"], printed["adam_beta1"], printed["adam_beta2"]) == (
        "sgd", 0.0, None, None)


def test_normal_resolves_to_adam_with_sgd_momentum_off():
    r = resolve(TrainArgs(model_variant="tiny", run_id="t", mode="normal", task="dapo-math"))
    assert (r.optimizer.optimizer, r.optimizer.adam_beta1, r.optimizer.adam_beta2) == ("adam", 0.9, 0.98)
    printed = r.to_dict()
    assert (printed["optimizer"], printed["sgd_momentum"], printed["adam_beta1"], printed["adam_beta2"]) == (
        "adam", None, 0.9, 0.98)


@pytest.mark.parametrize("mode, want", [("debug_minimal", ("sgd", 0.0)), ("normal", ("adam", 0.0))])
def test_the_loop_hands_the_optimizer_to_both_trainers(mode, want):
    from k3.rl.loop import _grpo_config

    r = resolve(TrainArgs(model_variant="tiny", run_id="t", mode=mode, task="dapo-math"))
    grpo = _grpo_config(r.settings)
    assert (grpo.optimizer, grpo.sgd_momentum) == want
    assert grpo.lr == r.optimizer.lr and grpo.weight_decay == r.optimizer.weight_decay


# ---------------------------------------------------------------------------------------------- end to end
def test_a_debug_minimal_run_trains_with_sgd_and_a_normal_mode_resume_of_it_is_refused(tmp_path, monkeypatch, capsys):
    """``k3 train --mode debug_minimal`` (tiny, torch backend, in process) prints and saves SGD; resuming that run
    in normal mode (Adam) stops, before any trainer loads anything, in one line."""
    from k3.config import variant
    from k3.launch.train import main as train_main
    from k3.model import KimiK3ForCausalLM
    from k3.rl.data.arith import write_arith_dataset
    from k3.rl.resume import latest_checkpoint, load_checkpoint_state

    monkeypatch.setenv("K3_IN_PROCESS", "1")
    torch.manual_seed(0)
    KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).save_pretrained(tmp_path / "base")
    write_arith_dataset(tmp_path / "data" / "arith", n_train=64, n_eval=8, seed=0)
    run = tmp_path / "run"

    def argv(mode: str, *extra: str) -> list[str]:
        return ["--mode", mode, "--model-variant", "tiny", "--task", "arith", "--num-rollout", "1",
                "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                "--rollout-max-response-len", "6", "--save-interval", "1", "--hf-checkpoint", str(tmp_path / "base"),
                "--data-dir", str(tmp_path / "data"), "--run-dir", str(run), *extra]

    assert train_main(argv("debug_minimal")) == 0
    lines = (run / "resolved_config.txt").read_text().splitlines()
    printed = {line.split()[0]: line.split()[-1] for line in lines if " ..." in line}
    assert (printed["optimizer"], printed["sgd_momentum"], printed["lr"], printed["adam_beta1"]) == (
        "sgd", "0.0", "1e-06", "None")
    state = load_checkpoint_state(latest_checkpoint(run))
    assert state["optimizer_kind"] == "sgd" and state["optimizer"]["state"] == {}  # momentum 0: no state
    assert all(g["momentum"] == 0.0 and "betas" not in g for g in state["optimizer"]["param_groups"])
    capsys.readouterr()
    assert train_main(argv("normal", "--resume", "--num-rollout", "2")) == 1
    err = capsys.readouterr().err
    assert ("error: --resume: the optimizer state was saved by sgd; this run trains with adam: resume in the --mode "
            "that saved it (debug_minimal: sgd, normal: adam), or start a new run") in err, err
    assert "Traceback" not in err
