"""--gpu-memory-fraction-per-actor / --gpu-memory-gb-per-actor: each colocated actor caps its CUDA allocator at a
share of its GPU, or at so many GiB of it.

The flag resolves into ``ColocateSettings`` (printed in the resolved config), travels to the workers in their
``WorkerSpec``, and every trainer rank and the embedded engine apply it first thing at start. A CPU run refuses it
(a printed cap must be one in effect); the cap itself is checked on CUDA (gpu-marked) and, on CPU, the call it makes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

import k3.transport.memory_cap as memory_cap
from k3.launch.args import LaunchConfigError, TrainArgs, resolve
from k3.launch.parser import parse_train_args
from k3.launch.resolved_config import TEXT_NAME, write_resolved_config
from k3.rl.loop import worker_spec
from k3.settings.lora import LoRAConfig
from k3.settings.worker import WorkerSpec
from k3.transport.memory_cap import MemoryCapError, apply_gpu_memory_cap

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


def test_the_gib_form_resolves_into_its_own_line_and_the_worker_spec(tmp_path):
    args = parse_train_args("--model-variant tiny --num-gpus-per-node 1 --gpu-memory-gb-per-actor 35 "
                            "--no-ipc-unlink-shim --hf-checkpoint /ckpt --run-id cap".split(), environ={})
    r = resolve(args)
    assert (r.colocate.gpu_memory_gb_per_actor, r.colocate.gpu_memory_fraction_per_actor) == (35.0, None)
    write_resolved_config(r, tmp_path)
    lines = [line.split() for line in (tmp_path / TEXT_NAME).read_text().splitlines() if "gpu_memory_" in line]
    assert lines == [["gpu_memory_fraction_per_actor", "." * 19, "None"], ["gpu_memory_gb_per_actor", "." * 25, "35.0"]]
    spec = worker_spec(r.settings)
    assert (spec.gpu_memory_gb_per_actor, spec.gpu_memory_fraction_per_actor) == (35.0, None)
    env = parse_train_args(["--num-gpus-per-node", "1"], environ={"K3_GPU_MEMORY_GB_PER_ACTOR": "20.5"})
    assert env.gpu_memory_gb_per_actor == 20.5


def test_both_units_at_once_are_refused():
    assert error_of(one_gpu(gpu_memory_fraction_per_actor=0.25, gpu_memory_gb_per_actor=35.0)) == (
        "--gpu-memory-fraction-per-actor 0.25 and --gpu-memory-gb-per-actor 35.0 are the same cap in two units: "
        "give one")


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_gib_that_are_not_a_positive_number_are_refused(value):
    assert error_of(one_gpu(gpu_memory_gb_per_actor=value)) == (
        f"--gpu-memory-gb-per-actor {value}: must be a positive number of GiB")


def test_a_cpu_run_refuses_the_gib_cap_too():
    assert error_of(one_gpu(num_gpus_per_node=0, gpu_memory_gb_per_actor=35.0)) == (
        "--gpu-memory-gb-per-actor 35.0 caps each actor's CUDA allocator, and this run is on CPU "
        "(--num-gpus-per-node 0): drop the flag")


def test_an_engine_that_does_not_apply_it_refuses_it():
    args = TrainArgs(model_variant="4layer", rollout_engine="sglang", run_id="cap", ipc_unlink_shim=False,
                     gpu_memory_fraction_per_actor=0.5)
    assert "--rollout-engine sglang sizes its own memory" in error_of(args)
    args = dataclasses.replace(args, gpu_memory_fraction_per_actor=None, gpu_memory_gb_per_actor=30.0)
    assert error_of(args).startswith("--gpu-memory-gb-per-actor is applied by the trainer and the embedded engine; "
                                     "--rollout-engine sglang sizes its own memory")


# ------------------------------------------------------------------------------------------------ applying it
def test_no_cap_does_nothing_anywhere():
    assert apply_gpu_memory_cap("cpu", "embedded engine") is None
    assert apply_gpu_memory_cap("cpu", "embedded engine", fraction=None, gb=None) is None


def test_a_cpu_actor_cannot_honour_a_cap():
    with pytest.raises(MemoryCapError, match=r"^trainer rank 3: --gpu-memory-fraction-per-actor 0.5 caps a CUDA "
                                             r"allocator, and this actor runs on cpu"):
        apply_gpu_memory_cap("cpu", "trainer rank 3", fraction=0.5)
    with pytest.raises(MemoryCapError, match=r"^embedded engine: --gpu-memory-gb-per-actor 35 caps a CUDA "
                                             r"allocator, and this actor runs on cpu"):
        apply_gpu_memory_cap("cpu", "embedded engine", gb=35)


@pytest.mark.parametrize("value", [0, 1.01, math.nan, True, "0.5"])
def test_a_bad_fraction_is_an_error(value):
    with pytest.raises(ValueError, match="must be a number in"):
        apply_gpu_memory_cap("cuda:0", "x", fraction=value)


@pytest.mark.parametrize("value", [0, -2.0, math.nan, math.inf, True, "35"])
def test_bad_gib_are_an_error(value):
    with pytest.raises(ValueError, match="must be a positive number of GiB"):
        apply_gpu_memory_cap("cuda:0", "x", gb=value)


def test_both_units_are_an_error():
    with pytest.raises(ValueError, match="give one cap, not both"):
        apply_gpu_memory_cap("cuda:0", "x", fraction=0.25, gb=35)


def _fake_cuda(monkeypatch, total_gib: float) -> list[tuple[float, int]]:
    calls: list[tuple[float, int]] = []

    class Props:
        total_memory = int(total_gib * GIB)

    monkeypatch.setattr(memory_cap.torch.cuda, "set_per_process_memory_fraction",
                        lambda f, index: calls.append((f, index)))
    monkeypatch.setattr(memory_cap.torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(memory_cap.torch.cuda, "current_device", lambda: 0)
    return calls


def test_the_cap_is_torch_s_per_process_fraction_on_the_actor_s_device(monkeypatch):
    calls = _fake_cuda(monkeypatch, 140)
    assert apply_gpu_memory_cap("cuda:1", "trainer rank 1", fraction=0.2) == (
        "trainer rank 1: GPU memory capped at 0.2 of cuda:1 (28.0 of 140.0 GiB)")
    assert apply_gpu_memory_cap("cuda", "embedded engine", fraction=0.5) == (
        "embedded engine: GPU memory capped at 0.5 of cuda:0 (70.0 of 140.0 GiB)")
    assert calls == [(0.2, 1), (0.5, 0)]


@pytest.mark.parametrize("total_gib, fraction", [(140.0, 0.25), (80.0, 0.4375)])
def test_a_gib_cap_is_the_same_bytes_on_any_device(monkeypatch, total_gib, fraction):
    calls = _fake_cuda(monkeypatch, total_gib)
    assert apply_gpu_memory_cap("cuda:0", "trainer rank 0", gb=35) == (
        f"trainer rank 0: GPU memory capped at 35 GiB of cuda:0 ({fraction:.4f} of {total_gib:.1f} GiB)")
    assert calls == [(fraction, 0)]
    assert calls[0][0] * int(total_gib * GIB) == 35 * GIB


def test_more_gib_than_the_device_has_is_refused_before_the_cap(monkeypatch):
    calls = _fake_cuda(monkeypatch, 79.2)
    with pytest.raises(MemoryCapError, match=r"^embedded engine: --gpu-memory-gb-per-actor 80 is more than cuda:0 "
                                             r"has \(79.2 GiB\): lower it$"):
        apply_gpu_memory_cap("cuda:0", "embedded engine", gb=80)
    assert calls == []


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

    def record(device, who, *, fraction, gb):
        seen.append((device, who, fraction, gb))
        raise _Applied

    monkeypatch.setattr(engine_worker, "apply_gpu_memory_cap", record)
    with pytest.raises(_Applied):  # a load before the cap would fail first: the checkpoint does not exist
        engine_worker.EngineWorker(_spec(device="cuda"), max_concurrency=4)
    with pytest.raises(_Applied):
        engine_worker.EngineWorker(_spec(device="cuda", gpu_memory_fraction_per_actor=None,
                                         gpu_memory_gb_per_actor=35.0), max_concurrency=4)
    assert seen == [("cuda", "embedded engine", 0.3, None), ("cuda", "embedded engine", None, 35.0)]


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

    def record(dev, who, *, fraction, gb):
        seen.append((fraction, dev, who))
        raise _Applied

    monkeypatch.setattr(trainer_worker, "apply_gpu_memory_cap", record)
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
@pytest.mark.parametrize("cap, line", [("fraction=0.05", "test: GPU memory capped at 0.05 of cuda:0"),
                                       ("gb=total * 0.05 / 2**30", "test: GPU memory capped at ")])
def test_on_cuda_an_allocation_past_the_cap_fails_in_that_process(cap, line):
    """Run in a child: the fraction stays set for the life of the process. 3% of the device fits under a 5% cap
    (in either unit), a second 3% does not."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from k3.transport.memory_cap import apply_gpu_memory_cap\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        f"print(apply_gpu_memory_cap('cuda:0', 'test', {cap}))\n"
        "x = torch.empty(int(total * 0.03), dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    y = torch.empty(int(total * 0.03), dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('OOM past the cap')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert line in out.stdout
    assert "OOM past the cap" in out.stdout
