"""The trainer's sleep / wake_up under the real torch_memory_saver on one CUDA device (``gpu``; skipped without CUDA
or without the package, the ``gpu`` extra): pausing drops the device's physical memory while
``torch.cuda.memory_allocated`` stays; resuming brings the parameters back bit for bit and the gradient buffers
zeroed; the exporter reads the adapters from the saver's backups while asleep; a torch trainer built in the regions
trains after a wake as it did before. (The CPU side of all of it: tests/unit/test_trainer_memory.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture(scope="module")
def regions():
    pytest.importorskip("torch_memory_saver")
    from k3.rl.trainers.memory_regions import SaverRegions, load_memory_saver

    return SaverRegions(load_memory_saver())


class Frozen(nn.Module):
    """A frozen base of 1 GiB and a small adapter, made on the device (inside whatever region is active)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(256 * MIB, device="cuda"), requires_grad=False)  # float32: 1 GiB
        self.adapter = nn.Parameter(torch.randn(4096, 16, device="cuda"))


def _physical() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_pause_drops_physical_memory_while_allocated_stays_and_resume_restores_bit_for_bit(regions):
    from k3.rl.trainers.megatron import DDPGradBuffers
    from k3.rl.trainers.memory_regions import TrainerMemory

    torch.manual_seed(0)
    with regions.params():
        model = Frozen()
    with regions.grad_buffers():
        grad = torch.full((128 * MIB,), 3.0, device="cuda")  # 512 MiB of "gradients"
    chunk = SimpleNamespace(buffers=[SimpleNamespace(grad_data=grad)], expert_parallel_buffers=[],
                            zero_grad_buffer=lambda: grad.zero_())
    memory = TrainerMemory(regions, model, DDPGradBuffers([chunk]), "cuda")
    snapshot = {n: p.detach().cpu() for n, p in model.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + grad.numel() * 4

    allocated, physical = torch.cuda.memory_allocated(), _physical()
    readings = memory.sleep()
    assert torch.cuda.memory_allocated() == allocated  # paused memory keeps its virtual allocation
    assert physical - _physical() >= 0.95 * nbytes  # ... and gives its physical memory back
    before, after = readings
    assert after["memory/allocated_gb"] == before["memory/allocated_gb"]
    assert before["memory/physical_gb"] - after["memory/physical_gb"] >= 0.95 * nbytes / 2**30

    with memory.readable():  # the exporter's view while asleep: the adapter from its backup
        assert torch.equal(model.adapter.detach().cpu(), snapshot["adapter"])
    memory.wake_up()
    assert _physical() - physical < 64 * MIB
    assert all(torch.equal(p.detach().cpu(), snapshot[n]) for n, p in model.named_parameters())
    assert torch.count_nonzero(grad) == 0  # the discarded region came back as fresh memory, zeroed


def test_a_torch_trainer_in_the_regions_exports_while_asleep_and_trains_after_waking(tmp_path, regions):
    from layout_parity import trajectories
    from tiny_checkpoint import write_tiny_checkpoint

    from k3.lora import LoRAConfig
    from k3.lora.digest import chunk_digest
    from k3.lora.export import export_chunks
    from k3.rl.grpo import GRPOConfig
    from k3.rl.trainer_worker import TrainerWorker
    from k3.settings.worker import WorkerSpec

    base = write_tiny_checkpoint(tmp_path)
    spec = WorkerSpec(model_dir=str(base), lora=LoRAConfig(rank=4, alpha=8.0), device="cuda", dtype="bfloat16",
                      seed=3, offload_train=True)
    worker = TrainerWorker(spec, GRPOConfig(lr=5e-3), 64)
    trajs = trajectories(worker.policy.model.config.vocab_size)
    for t, lp in zip(trajs, worker.log_probs(trajs)):
        t.old_log_probs = lp
    worker.train_step(trajs)
    awake = [chunk_digest(c.tensors) for c in export_chunks(worker.policy.model, 1)]
    log_probs = worker.log_probs(trajs)
    assert [r["phase"] for r in worker.sleep()] == ["before_offload", "after_offload"]
    with worker._adapters_readable():
        assert [chunk_digest(c.tensors) for c in export_chunks(worker.policy.model, 1)] == awake
    worker.wake_up()
    assert worker.log_probs(trajs) == log_probs
    worker.train_step(trajs)


def test_retained_backups_carry_each_sleeps_values(regions):
    """The saver keeps its pinned backups across resumes (``retain_cpu_backup``): every later sleep refreshes them in
    place, so what a wake brings back is what the parameters held at that sleep, not at the first one."""
    from k3.rl.trainers.megatron import DDPGradBuffers
    from k3.rl.trainers.memory_regions import TrainerMemory

    torch.manual_seed(1)
    with regions.params():
        model = Frozen()
    memory = TrainerMemory(regions, model, DDPGradBuffers([]), "cuda")
    for cycle in range(3):
        with torch.no_grad():
            model.adapter.add_(1.0)
        want = model.adapter.detach().cpu()
        memory.sleep()
        assert regions.saver.retain_cpu_backup  # turned on by the first pause (SaverRegions.pause)
        memory.wake_up()
        assert torch.equal(model.adapter.detach().cpu(), want), cycle
