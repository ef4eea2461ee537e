"""The recipe's debug_minimal optimizer, SGD, on the megatron trainer, on two gloo ranks (CPU, DP2, TP1; the batch
split over the ranks), from the same adapters each time (B drawn non-zero, so every factor has a gradient):

- plain SGD at momentum 0: one step is ``p − lr·g`` (closed form, ``g`` the data-parallel mean gradient megatron
  hands the optimizer, read from ``main_grad``), and the optimizer holds no state at all (torch's SGD; TE's
  FusedSGD would keep a momentum buffer); at momentum ``m`` two steps are ``p1 = p0 − lr·g0``,
  ``p2 = p1 − lr·(m·g0 + g1)``.
- megatron's distributed optimizer with SGD (megatron-core 0.16.1 admits only Adam there; ``k3.megatron.optimizer``
  widens that one check): its steps equal the plain optimizer's, the momentum buffers are sharded over the two
  ranks (the halves add up to the whole), and the replicas agree after the all-gather.
- resume: each rank's state (plain, distributed; momentum 0 and ``m``; and BF16 parameters under the distributed
  optimizer, where the fp32 main weights are not the parameters) goes through ``torch.save`` /
  ``torch.load(weights_only=True)``, and a resumed step equals the uninterrupted one bit for bit. The run's lr and
  momentum stay in effect over a state saved with others. An Adam state into SGD, and SGD into Adam, is refused in
  one line.

On CUDA (``gpu``, one rank, no compatibility module): the distributed SGD over BF16 parameters at momentum 0 and
``m``, its first step the closed form up to BF16 rounding, and its resume bit for bit.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from layout_parity import trajectories

RANK, ALPHA = 4, 8.0
MAX_TOKENS = 24
LR = 5e-2  # large, so the update stands far above float32 rounding
MOMENTUM = 0.9


# ---------------------------------------------------------------------------------------------- the worker
def _policy(root: Path, *, optimizer: str = "sgd", momentum: float = 0.0, lr: float = LR, **kwargs):
    from k3.lora import LoRAConfig
    from k3.megatron.lora import gather_lora, load_lora
    from k3.megatron.optimizer import reload_main_params
    from k3.rl.grpo import GRPOConfig
    from k3.rl.trainers.megatron import build_megatron_policy

    # clip 0: no clipping, so the gradient megatron steps with is main_grad itself; weight decay 0 (the recipe's)
    grpo = GRPOConfig(lr=lr, weight_decay=0.0, clip_grad=0.0, optimizer=optimizer, sgd_momentum=momentum)
    policy = build_megatron_policy(root / "base", LoRAConfig(rank=RANK, alpha=ALPHA), pad_id=0, grpo=grpo,
                                   max_tokens_per_micro_batch=MAX_TOKENS, seed=3, **kwargs)
    gen = torch.Generator().manual_seed(11)
    state = {k: (0.05 * torch.randn(v.shape, generator=gen) if k.endswith("lora_B") else v)
             for k, v in sorted(gather_lora(policy.model).items())}
    load_lora(policy.model, state)
    # BF16 parameters: the optimizer's fp32 main weights were copied from the parameters when it was built (B = 0),
    # and load_lora writes the parameters only
    reload_main_params(policy.trainer.optimizer)
    return policy


def _trajs(policy):
    trajs = trajectories(policy.cfg.vocab_size)
    for t, lp in zip(trajs, policy.log_probs(trajs)):
        t.old_log_probs = [x - 0.05 for x in lp]  # a ratio off 1
    return trajs


def _local(policy) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]


def _values(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in _local(policy)}


def _grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().float().clone() for n, p in _local(policy)}


def _state_numel(policy) -> int:
    """Elements of tensors the optimizer(s) hold as state (momentum buffers; not the main weights)."""
    optimizer = policy.trainer.optimizer
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(v.numel() for part in parts for s in part.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _saved(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _run(root: Path, name: str, out: dict, **kwargs) -> None:
    """Two steps (values and gradients around each), the state round trip, a resumed step."""
    from megatron.core import parallel_state

    from k3.megatron.lora import gather_lora, load_lora

    policy = _policy(root, **kwargs)
    trajs = _trajs(policy)
    got: dict = {"p0": _values(policy), "trainable": sum(p.numel() for _, p in _local(policy)),
                 "inner": [f"{type(part.optimizer).__module__}.{type(part.optimizer).__name__}" for part in
                           getattr(policy.trainer.optimizer, "chained_optimizers", [policy.trainer.optimizer])]}
    got["step0"] = policy.train_step(trajs)
    got["g0"], got["p1"] = _grads(policy), _values(policy)
    got["state_numel_1"] = _state_numel(policy)
    got["step1"] = policy.train_step(trajs)
    got["g1"], got["p2"] = _grads(policy), _values(policy)
    got["final"] = gather_lora(policy.model)
    state = policy.optimizer_state()
    got["kind"], got["distributed"] = state["optimizer_kind"], state["distributed_optimizer"]
    data = _saved(state)
    del state
    snapshot = gather_lora(policy.model)
    policy.train_step(trajs)
    straight = gather_lora(policy.model)
    load_lora(policy.model, {k: torch.zeros_like(v) for k, v in snapshot.items()})  # the load must restore
    load_lora(policy.model, snapshot)
    policy.load_optimizer_state(_loaded(data))
    got["after_load"] = gather_lora(policy.model)
    policy.train_step(trajs)
    got["resume_equal"] = all(torch.equal(straight[k], v) for k, v in gather_lora(policy.model).items())
    got["state_bytes"] = data
    out[name] = got
    parallel_state.destroy_model_parallel()  # the process group stays for the next policy


def _hyperparameters(root: Path, out: dict) -> None:
    """A state saved at lr LR / momentum MOMENTUM into a run of 2·LR / 0.5: the run's stay in effect."""
    from megatron.core import parallel_state

    for name, distributed in (("plain_m", False), ("distributed_m", True)):
        policy = _policy(root, momentum=0.5, lr=2 * LR, use_distributed_optimizer=distributed)
        policy.load_optimizer_state(_loaded(out[name]["state_bytes"]))
        out[f"{name}_groups"] = [(g["lr"], g["momentum"]) for g in policy.trainer.optimizer.param_groups]
        parallel_state.destroy_model_parallel()


def _refusals(root: Path, out: dict) -> None:
    """Adam into SGD and SGD into Adam, plain and distributed."""
    from megatron.core import parallel_state

    for distributed in (False, True):
        which = "distributed" if distributed else "plain"
        adam = _policy(root, optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed)
        trajs = _trajs(adam)
        adam.train_step(trajs)
        adam_state = _saved(adam.optimizer_state())
        out[f"sgd_into_adam_{which}"] = _error(lambda: adam.load_optimizer_state(
            _loaded(out[which]["state_bytes"])))
        parallel_state.destroy_model_parallel()
        sgd = _policy(root, use_distributed_optimizer=distributed)
        out[f"adam_into_sgd_{which}"] = _error(lambda: sgd.load_optimizer_state(_loaded(adam_state)))
        parallel_state.destroy_model_parallel()


def _adapter_load_bf16(root: Path, out: dict) -> None:
    """``load_adapter`` into BF16 parameters under the distributed optimizer, then a step too small to change a
    BF16 value: the adapters stay the loaded ones only if the load refreshed the optimizer's fp32 main weights (a
    stale copy, here the zeroed B, would be written back by the step)."""
    from megatron.core import parallel_state

    from k3.megatron.lora import gather_lora, load_lora
    from k3.megatron.optimizer import reload_main_params

    policy = _policy(root, lr=1e-12, use_distributed_optimizer=True, dtype=torch.bfloat16)
    loaded = gather_lora(policy.model)
    saved = policy.save_adapter(root / "adapter_bf16")  # collective; global rank 0 writes
    torch.distributed.barrier()  # the others read it only once written
    load_lora(policy.model, {k: torch.zeros_like(v) if k.endswith("lora_B") else v for k, v in loaded.items()})
    reload_main_params(policy.trainer.optimizer)  # a fresh policy: B = 0 in the main weights
    policy.load_adapter(saved)
    policy.train_step(_trajs(policy))
    out["adapter_load_bf16_kept"] = all(torch.equal(loaded[k], v) for k, v in gather_lora(policy.model).items())
    parallel_state.destroy_model_parallel()


def _sgd_worker(root: Path) -> None:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist

    from k3.megatron.parallel import destroy_parallel

    out: dict = {}
    _run(root, "plain", out)
    _run(root, "distributed", out, use_distributed_optimizer=True)
    _run(root, "plain_m", out, momentum=MOMENTUM)
    _run(root, "distributed_m", out, momentum=MOMENTUM, use_distributed_optimizer=True)
    # BF16 parameters: the distributed optimizer's fp32 main weights are copies, which the state must restore
    _run(root, "distributed_bf16", out, use_distributed_optimizer=True, dtype=torch.bfloat16)
    _hyperparameters(root, out)
    _refusals(root, out)
    _adapter_load_bf16(root, out)
    for got in out.values():
        if isinstance(got, dict):
            got.pop("state_bytes", None)
    torch.save(out, root / f"sgd_rank{dist.get_rank()}.pt")
    destroy_parallel()


def _sgd_gpu_worker(root: Path) -> None:
    """CUDA (no compatibility module), one rank: megatron's distributed optimizer with SGD over BF16 parameters,
    momentum 0 and MOMENTUM."""
    from k3.megatron.parallel import destroy_parallel

    out: dict = {}
    _run(root, "distributed", out, use_distributed_optimizer=True, dtype=torch.bfloat16)
    _run(root, "distributed_m", out, momentum=MOMENTUM, use_distributed_optimizer=True, dtype=torch.bfloat16)
    for got in out.values():
        got.pop("state_bytes", None)
    torch.save(out, root / "sgd_gpu.pt")
    destroy_parallel()


if __name__ == "__main__":
    {"sgd": _sgd_worker, "sgd_gpu": _sgd_gpu_worker}[sys.argv[1]](Path(sys.argv[2]))


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from megatron_compat import run_workers
    from tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("megatron_sgd")
    write_tiny_checkpoint(root)
    run_workers([__file__, "sgd", str(root)], nproc=2, timeout=600)
    return [torch.load(root / f"sgd_rank{r}.pt", weights_only=False) for r in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_close_form(got: dict, want: dict, step_size: dict) -> None:
    for name, w in want.items():
        # float32: the step is one fused multiply-add away from the float64 closed form; the update itself is
        # orders above that
        torch.testing.assert_close(got[name].double(), w, rtol=0, atol=1e-7, msg=name)
    assert max(s.abs().max().item() for s in step_size.values()) > 1e-4


@pytest.mark.slow
def test_one_sgd_step_at_momentum_0_is_p_minus_lr_g_and_holds_no_state(ranks):
    for r in ranks:
        got = r["plain"]
        # torch's SGD (not TE's FusedSGD), for the dense and the expert-parallel parameters megatron chains
        assert got["inner"] == ["torch.optim.sgd.SGD"] * 2 and got["kind"] == "sgd"
        want = {n: got["p0"][n].double() - LR * got["g0"][n].double() for n in got["p0"]}
        _assert_close_form(got["p1"], want, got["g0"])
        want = {n: got["p1"][n].double() - LR * got["g1"][n].double() for n in got["p1"]}
        _assert_close_form(got["p2"], want, got["g1"])
        assert got["state_numel_1"] == 0  # torch's SGD at momentum 0: no momentum buffer
        assert r["distributed"]["state_numel_1"] == 0


@pytest.mark.slow
def test_two_sgd_steps_with_momentum_are_the_closed_form(ranks):
    for r in ranks:
        got = r["plain_m"]
        want = {n: got["p0"][n].double() - LR * got["g0"][n].double() for n in got["p0"]}
        _assert_close_form(got["p1"], want, got["g0"])
        want = {n: got["p1"][n].double() - LR * (MOMENTUM * got["g0"][n].double() + got["g1"][n].double())
                for n in got["p1"]}
        _assert_close_form(got["p2"], want, got["g1"])
        assert got["state_numel_1"] == got["trainable"]  # one momentum buffer per parameter, whole on each rank


@pytest.mark.slow
@pytest.mark.parametrize("momentum", ["", "_m"])
def test_distributed_sgd_equals_the_plain_sgd_and_shards_its_momentum(ranks, momentum):
    for r in ranks:
        plain, dist = r["plain" + momentum], r["distributed" + momentum]
        assert dist["distributed"] and not plain["distributed"] and dist["kind"] == "sgd"
        for a, b in zip((dist["step0"], dist["step1"]), (plain["step0"], plain["step1"])):
            for key in ("train/loss", "train/grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])
        for name, b in plain["final"].items():
            assert _rel(dist["final"][name], b) < 1e-5, name
    for name, b in ranks[0]["distributed" + momentum]["final"].items():  # the replicas agree after the all-gather
        assert torch.equal(ranks[1]["distributed" + momentum]["final"][name], b), name
    if momentum:
        held = [r["distributed_m"]["state_numel_1"] for r in ranks]
        total = ranks[0]["plain_m"]["trainable"]
        assert sum(held) == total and all(0.3 * total < h < 0.7 * total for h in held), (held, total)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain", "distributed", "plain_m", "distributed_m", "distributed_bf16"])
def test_sgd_optimizer_state_round_trip_resumes_bit_for_bit(ranks, which):
    for r in ranks:
        assert r[which]["resume_equal"], which
    for name, b in ranks[0][which]["after_load"].items():  # both replicas hold the restored adapters at once
        assert torch.equal(ranks[1][which]["after_load"][name], b), name


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain_m", "distributed_m"])
def test_a_resume_keeps_the_runs_lr_and_momentum(ranks, which):
    for r in ranks:
        assert set(r[f"{which}_groups"]) == {(2 * LR, 0.5)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain", "distributed"])
def test_an_optimizer_state_of_the_other_optimizer_is_refused(ranks, which):
    for r in ranks:
        assert r[f"adam_into_sgd_{which}"] == (
            "ValueError: the optimizer state was saved by adam; this run trains with sgd: resume in the --mode that "
            "saved it (debug_minimal: sgd, normal: adam), or start a new run")
        assert r[f"sgd_into_adam_{which}"].startswith(
            "ValueError: the optimizer state was saved by sgd; this run trains with adam")


@pytest.mark.slow
def test_a_loaded_adapter_survives_the_next_step_in_bf16_under_the_distributed_optimizer(ranks):
    assert all(r["adapter_load_bf16_kept"] for r in ranks)


@pytest.mark.gpu
def test_distributed_sgd_on_cuda_steps_the_closed_form_and_resumes_bit_for_bit(tmp_path):
    from megatron_compat import run_workers
    from tiny_checkpoint import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path)
    run_workers([__file__, "sgd_gpu", str(tmp_path)], nproc=1, timeout=600)
    out = torch.load(tmp_path / "sgd_gpu.pt", weights_only=False)
    for which, momentum in (("distributed", 0.0), ("distributed_m", MOMENTUM)):
        got = out[which]
        assert got["inner"] == ["torch.optim.sgd.SGD"] * 2 and got["distributed"] and got["resume_equal"], which
        assert got["state_numel_1"] == (got["trainable"] if momentum else 0), which
        for name, p0 in got["p0"].items():  # BF16 parameters: the fp32 main weight's closed form, rounded
            want = p0.double() - LR * got["g0"][name].double()
            torch.testing.assert_close(got["p1"][name].double(), want, rtol=8e-3, atol=1e-6, msg=name)
