"""--gpu-memory-fraction-per-actor: each colocated actor caps its CUDA allocator at a share of its GPU.

The flag resolves into ``ColocateSettings`` (printed in the resolved config), travels to the workers in their
``WorkerSpec``, and every trainer rank and the embedded engine apply it first thing at start. A CPU run refuses it
(a printed cap must be one in effect); the cap itself is checked on CUDA (gpu-marked) and, on CPU, the call it makes.
"""

from __future__ import annotations

import math

import pytest

import k3.transport.memory_cap as memory_cap
from k3.launch.args import LaunchConfigError, TrainArgs, resolve
from k3.launch.parser import parse_train_args
from k3.launch.resolved_config import TEXT_NAME, write_resolved_config
from k3.rl.loop import worker_spec
from k3.settings.lora import LoRAConfig
from k3.settings.worker import WorkerSpec
from k3.transport.memory_cap import MemoryCapError, apply_gpu_memory_fraction

GIB = 1024**3


def one_gpu(**changes) -> TrainArgs:
    base = dict(model_variant="tiny", num_gpus_per_node=1, run_id="cap", hf_checkpoint="/ckpt", ipc_unlink_shim=False)
    base.update(changes)
    return TrainArgs(**base)


def error_of(args: TrainArgs) -> str:
    with pytest.raises(LaunchConfigError) as e:
        resolve(args)
    return str(e.value)


# ------------------------------------------------------------------------------------------------ the flag
def test_the_flag_resolves_into_the_settings_the_dump_and_the_worker_spec(tmp_path):
    args = parse_train_args("--model-variant tiny --num-gpus-per-node 1 --gpu-memory-fraction-per-actor 0.25 "
                            "--no-ipc-unlink-shim --hf-checkpoint /ckpt --run-id cap".split(), environ={})
    r = resolve(args)
    assert r.colocate.gpu_memory_fraction_per_actor == 0.25
    assert r.to_dict()["gpu_memory_fraction_per_actor"] == 0.25
    write_resolved_config(r, tmp_path)
    lines = [line for line in (tmp_path / TEXT_NAME).read_text().splitlines() if "gpu_memory_fraction" in line]
    assert [line.split() for line in lines] == [["gpu_memory_fraction_per_actor", "." * 19, "0.25"]]
    assert worker_spec(r.settings).gpu_memory_fraction_per_actor == 0.25


def test_the_environment_sets_it_and_the_default_is_no_cap():
    args = parse_train_args(["--num-gpus-per-node", "1"], environ={"K3_GPU_MEMORY_FRACTION_PER_ACTOR": "0.4"})
    assert args.gpu_memory_fraction_per_actor == 0.4
    r = resolve(one_gpu())
    assert r.colocate.gpu_memory_fraction_per_actor is None
    assert worker_spec(r.settings).gpu_memory_fraction_per_actor is None


def test_a_cpu_run_refuses_the_cap():
    assert error_of(one_gpu(num_gpus_per_node=0, gpu_memory_fraction_per_actor=0.3)) == (
        "--gpu-memory-fraction-per-actor 0.3 caps each actor's CUDA allocator, and this run is on CPU "
        "(--num-gpus-per-node 0): drop the flag")


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_a_fraction_outside_0_1_is_refused(value):
    assert f"--gpu-memory-fraction-per-actor {value}: must be in (0, 1]" in error_of(
        one_gpu(gpu_memory_fraction_per_actor=value))


def test_one_is_the_whole_device_and_allowed():
    assert resolve(one_gpu(gpu_memory_fraction_per_actor=1.0)).colocate.gpu_memory_fraction_per_actor == 1.0


def test_an_engine_that_does_not_apply_it_refuses_it():
    args = TrainArgs(model_variant="4layer", rollout_engine="sglang", run_id="cap", ipc_unlink_shim=False,
                     gpu_memory_fraction_per_actor=0.5)
    assert "--rollout-engine sglang sizes its own memory" in error_of(args)


# ------------------------------------------------------------------------------------------------ applying it
def test_no_cap_does_nothing_anywhere():
    assert apply_gpu_memory_fraction(None, "cpu", "embedded engine") is None


def test_a_cpu_actor_cannot_honour_a_cap():
    with pytest.raises(MemoryCapError, match=r"^trainer rank 3: --gpu-memory-fraction-per-actor 0.5 caps a CUDA "
                                             r"allocator, and this actor runs on cpu"):
        apply_gpu_memory_fraction(0.5, "cpu", "trainer rank 3")


@pytest.mark.parametrize("value", [0, 1.01, math.nan, True, "0.5"])
def test_a_bad_fraction_is_an_error(value):
    with pytest.raises(ValueError, match="must be a number in"):
        apply_gpu_memory_fraction(value, "cuda:0", "x")


def test_the_cap_is_torch_s_per_process_fraction_on_the_actor_s_device(monkeypatch):
    calls = []

    class Props:
        total_memory = 140 * GIB

    monkeypatch.setattr(memory_cap.torch.cuda, "set_per_process_memory_fraction",
                        lambda f, index: calls.append((f, index)))
    monkeypatch.setattr(memory_cap.torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(memory_cap.torch.cuda, "current_device", lambda: 0)
    assert apply_gpu_memory_fraction(0.2, "cuda:1", "trainer rank 1") == (
        "trainer rank 1: GPU memory capped at 0.2 of cuda:1 (28.0 of 140.0 GiB)")
    assert apply_gpu_memory_fraction(0.5, "cuda", "embedded engine") == (
        "embedded engine: GPU memory capped at 0.5 of cuda:0 (70.0 of 140.0 GiB)")
    assert calls == [(0.2, 1), (0.5, 0)]


class _Applied(Exception):
    pass


def _spec(**changes) -> WorkerSpec:
    base = dict(model_dir="/nonexistent/checkpoint", lora=LoRAConfig(rank=4, alpha=8), device="cpu",
                gpu_memory_fraction_per_actor=0.3)
    base.update(changes)
    return WorkerSpec(**base)


def test_the_engine_worker_applies_the_cap_before_it_loads_anything(monkeypatch):
    import k3.rollout.embedded.worker as engine_worker

    seen = []

    def record(fraction, device, who):
        seen.append((fraction, device, who))
        raise _Applied

    monkeypatch.setattr(engine_worker, "apply_gpu_memory_fraction", record)
    with pytest.raises(_Applied):  # a load before the cap would fail first: the checkpoint does not exist
        engine_worker.EngineWorker(_spec(device="cuda"), max_concurrency=4)
    assert seen == [(0.3, "cuda", "embedded engine")]


def test_the_engine_worker_on_cpu_stops_with_the_cap_s_error():
    from k3.rollout.embedded.worker import EngineWorker

    with pytest.raises(MemoryCapError, match="embedded engine: --gpu-memory-fraction-per-actor 0.3"):
        EngineWorker(_spec(), max_concurrency=4)


@pytest.mark.parametrize("backend, local_rank, device", [("megatron", "2", "cuda:2"), ("torch", "2", "cuda"),
                                                         ("torch", None, "cpu")])
def test_the_trainer_worker_applies_the_cap_first_on_its_rank_s_device(monkeypatch, backend, local_rank, device):
    import k3.rl.trainer_worker as trainer_worker
    from k3.rl.grpo import GRPOConfig

    seen = []

    def record(fraction, dev, who):
        seen.append((fraction, dev, who))
        raise _Applied

    monkeypatch.setattr(trainer_worker, "apply_gpu_memory_fraction", record)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    spec = _spec(backend=backend, device="cpu" if local_rank is None else "cuda")
    with pytest.raises(_Applied):
        trainer_worker.TrainerWorker(spec, GRPOConfig(), 512, rank=5)
    assert seen == [(0.3, device, "trainer rank 5")]


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_on_cuda_an_allocation_past_the_cap_fails_in_that_process():
    """Run in a child: the fraction stays set for the life of the process."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from k3.transport.memory_cap import apply_gpu_memory_fraction\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "print(apply_gpu_memory_fraction(0.05, 'cuda:0', 'test'))\n"
        "x = torch.empty(int(total * 0.03), dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    y = torch.empty(int(total * 0.03), dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('OOM past the cap')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "test: GPU memory capped at 0.05 of cuda:0" in out.stdout
    assert "OOM past the cap" in out.stdout

