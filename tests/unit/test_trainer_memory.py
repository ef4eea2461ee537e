"""The trainer's sleep / wake_up / offload_grad_buffer (``k3.rl.trainers.memory_regions``) on CPU: real moves of the
frozen base and the gradient buffers, bit-exact round trips, the export while asleep, training after a wake equal
to training without one, every failure path; the torch_memory_saver path with a stand-in saver (its API on CPU);
and the memory readings (``k3.transport.device_memory``). The megatron backend: tests/parity/test_megatron_sleep.py;
the real saver on CUDA: tests/unit/test_gpu_trainer_memory.py."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest
import torch
from layout_parity import trajectories
from lazy_saver import LazySaver
from tiny_checkpoint import write_tiny_checkpoint

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.digest import chunk_digest
from k3.lora.export import export_chunks
from k3.model import KimiK3ForCausalLM
from k3.rl.grpo import GRPOConfig
from k3.rl.trainers import memory_regions as mr
from k3.rl.trainers.memory_regions import (GRAD_BUFFER_TAG, PARAMS_TAG, HostRegions, ParamGrads, SaverRegions,
                                           TrainerMemory, TrainerMemoryError, resident_bytes, trainer_regions)
from k3.rl.trainers.megatron import DDPGradBuffers
from k3.rl.trainers.torch import PolicyTrainer
from k3.rollout.lora_model import load_lora_model
from k3.settings.worker import WorkerSpec
from k3.transport.device_memory import GIB, memory_reading

LORA = LoRAConfig(rank=4, alpha=8.0)
GRPO = GRPOConfig(lr=5e-3)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("trainer_memory"))


def _policy(base) -> PolicyTrainer:
    spec = WorkerSpec(model_dir=str(base), lora=LORA, seed=3)
    return PolicyTrainer(load_lora_model(spec), pad_id=0, grpo=GRPO, max_tokens_per_micro_batch=64)


def _trajs(policy: PolicyTrainer):
    trajs = trajectories(policy.model.config.vocab_size)
    for t, lp in zip(trajs, policy.log_probs(trajs)):
        t.old_log_probs = lp
    return trajs


def _memory(policy: PolicyTrainer, regions=None, rank: int = 0) -> TrainerMemory:
    return TrainerMemory(regions or HostRegions(), policy.model, policy.grad_buffers(), "cpu", rank)


def _frozen(policy):
    return {n: p for n, p in policy.model.named_parameters() if not p.requires_grad}


def _adapter_bytes(model) -> int:
    return resident_bytes(p for p in model.parameters() if p.requires_grad)


def _bytes(reading) -> int:
    return round(reading["memory/allocated_gb"] * GIB)


def _digests(model, version=1) -> list[str]:
    return [chunk_digest(c.tensors) for c in export_chunks(model, version)]


# ------------------------------------------------------------------------------------------------ readings
def test_memory_readings_on_cpu():
    r = memory_reading("before_offload", "cpu", 3 * GIB, rank=2)
    assert r["event"] == "memory" and r["phase"] == "before_offload" and r["rank"] == 2 and r["device"] == "cpu"
    assert r["memory/allocated_gb"] == 3.0  # the resident bytes given, in GiB
    assert r["memory/physical_gb"] > 0 and r["memory/rss_gb"] > 0 and "memory/reserved_gb" not in r
    engine = memory_reading("before_release", "cpu")  # an engine's: physical only
    assert "memory/allocated_gb" not in engine and engine["memory/physical_gb"] > 0
    with pytest.raises(ValueError, match="resident_bytes=-1 is negative"):
        memory_reading("x", "cpu", -1)


def test_resident_bytes_counts_each_storage_once_and_nothing_moved_away():
    a = torch.zeros(10)  # 40 bytes
    view = a[2:5]
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    assert resident_bytes([a, view, b]) == 64
    b.untyped_storage().resize_(0)
    assert resident_bytes([a, view, b]) == 40
    assert resident_bytes([]) == 0


def test_which_regions_a_trainer_gets(monkeypatch):
    assert trainer_regions(False, "cuda") is None and trainer_regions(False, "cpu") is None
    assert isinstance(trainer_regions(True, "cpu"), HostRegions)
    saver = StandInSaver()
    regions = trainer_regions(True, "cuda:0", saver_loader=lambda: saver)
    assert isinstance(regions, SaverRegions) and regions.saver is saver and regions.captures
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)  # not installed
    with pytest.raises(ImportError, match=r"--offload-train on a CUDA device needs torch_memory_saver: pip install "
                                          r"'torch-memory-saver==0\.0\.10'.*or pass --no-offload-train"):
        trainer_regions(True, "cuda")


# ------------------------------------------------------------------------------------------------ CPU: real moves
def test_sleep_moves_the_frozen_base_and_wake_up_brings_it_back_bit_for_bit(base):
    policy = _policy(base)
    policy.train_step(_trajs(policy))  # gradients exist
    memory = _memory(policy)
    frozen = _frozen(policy)
    snapshot = {n: p.detach().clone() for n, p in frozen.items()}
    adapters = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    every = resident_bytes(policy.model.parameters())
    grads = resident_bytes(policy.grad_buffers().tensors())
    assert grads == _adapter_bytes(policy.model) > 0

    slept = memory.sleep()
    assert [r["phase"] for r in slept] == ["before_offload", "after_offload"]
    assert _bytes(slept[0]) == every + grads
    # asleep, only the adapters are resident: the frozen base is in the host backup, the gradients are gone
    assert _bytes(slept[1]) == memory.resident_bytes() == _adapter_bytes(policy.model)
    assert all(p.numel() == 0 for p in frozen.values()) and policy.grad_buffers().tensors() == []
    assert memory.asleep and memory.grads_offloaded
    assert memory.sleep() == []  # idempotent: nothing moves twice

    woke = memory.wake_up()
    assert [r["phase"] for r in woke] == ["before_wake_up", "after_wake_up"]
    assert _bytes(woke[1]) == every  # the base is back; gradients come at the next backward
    assert all(torch.equal(p, snapshot[n]) for n, p in frozen.items())
    assert all(torch.equal(p, adapters[n]) for n, p in policy.model.named_parameters() if p.requires_grad)
    assert memory.wake_up() == [] and not memory.asleep and not memory.grads_offloaded
    memory.check_awake("train_step")


def test_training_after_a_wake_and_the_export_while_asleep_equal_the_run_without_sleep(base):
    plain, sleeper = _policy(base), _policy(base)
    trajs = _trajs(plain)
    memory = _memory(sleeper)

    first = plain.train_step(trajs)
    exported_awake = _digests(plain.model)
    assert sleeper.train_step(trajs) == first
    memory.sleep()
    with memory.readable():  # what update_weights and save_adapter do with the trainer asleep
        assert _digests(sleeper.model) == exported_awake
    memory.wake_up()
    assert sleeper.train_step(trajs) == plain.train_step(trajs)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), sleeper.model.named_parameters()):
        assert torch.equal(a, b), name


def test_offload_grad_buffer_drops_only_the_gradients(base):
    policy = _policy(base)
    policy.train_step(_trajs(policy))
    memory = _memory(policy)
    records = memory.offload_grad_buffer()
    assert [r["phase"] for r in records] == ["before_offload_grad_buffer", "after_offload_grad_buffer"]
    assert _bytes(records[0]) - _bytes(records[1]) == _adapter_bytes(policy.model)
    assert memory.offload_grad_buffer() == [] and not memory.asleep
    with pytest.raises(TrainerMemoryError, match="train_step while the trainer is without its gradient buffers"):
        memory.check_awake("train_step")
    assert [r["phase"] for r in memory.sleep()] == ["before_offload", "after_offload"]  # grads are not dropped twice
    memory.wake_up()
    memory.check_awake("train_step")


# ------------------------------------------------------------------------------------------------ failures
def test_a_wake_up_that_fails_midway_leaves_the_trainer_fully_asleep(base, monkeypatch):
    policy = _policy(base)
    trajs = _trajs(policy)
    policy.train_step(trajs)
    memory = _memory(policy, rank=3)
    frozen = _frozen(policy)
    snapshot = {n: p.detach().clone() for n, p in frozen.items()}
    memory.sleep()
    asleep_bytes = memory.resident_bytes()

    def planted(self, regions):
        raise RuntimeError("planted: no memory for the gradient buffers")

    monkeypatch.setattr(ParamGrads, "restore", planted)  # fails after the parameters were resumed
    with pytest.raises(TrainerMemoryError, match=r"^trainer rank 3: wake_up failed while resuming the gradient "
                                                 r"buffers: RuntimeError: planted: no memory for the gradient "
                                                 r"buffers \(the trainer is back asleep, nothing half-resumed\)$"):
        memory.wake_up()
    # the parameters it had resumed went back: the trainer is asleep exactly as before the call
    assert memory.asleep and memory.grads_offloaded and memory.resident_bytes() == asleep_bytes
    assert all(p.numel() == 0 for p in frozen.values())
    with pytest.raises(TrainerMemoryError, match="trainer rank 3: train_step while the trainer is asleep"):
        memory.check_awake("train_step")
    monkeypatch.undo()
    memory.wake_up()  # the next wake works, and the model is the one that went to sleep
    assert all(torch.equal(p, snapshot[n]) for n, p in frozen.items())
    policy.train_step(trajs)


def test_a_wake_up_whose_undo_fails_marks_the_trainer_broken(base, monkeypatch):
    policy = _policy(base)
    memory = _memory(policy, rank=1)
    memory.sleep()

    def planted(*args):
        raise RuntimeError("planted")

    monkeypatch.setattr(ParamGrads, "restore", planted)
    monkeypatch.setattr(TrainerMemory, "_pause_params", planted)
    with pytest.raises(TrainerMemoryError, match=r"trainer rank 1: wake_up failed while resuming the gradient buffers "
                                                 r"\(RuntimeError: planted\), and undoing it failed too "
                                                 r"\(RuntimeError: planted\): its memory is in an unknown state"):
        memory.wake_up()
    monkeypatch.undo()
    for step in (memory.wake_up, memory.sleep, lambda: memory.check_awake("log_probs")):
        with pytest.raises(TrainerMemoryError, match="refused: wake_up failed while resuming the gradient buffers"):
            step()
    with pytest.raises(TrainerMemoryError, match="reading the adapters refused"):
        with memory.readable():
            pass


def test_a_sleep_that_fails_midway_leaves_the_trainer_awake(base, monkeypatch):
    policy = _policy(base)
    frozen = _frozen(policy)
    snapshot = {n: p.detach().clone() for n, p in frozen.items()}
    # the CPU move: dropping the gradients fails
    memory = _memory(policy, rank=2)
    def planted(self, regions):
        raise OSError("planted")

    monkeypatch.setattr(ParamGrads, "release", planted)
    with pytest.raises(TrainerMemoryError, match=r"^trainer rank 2: sleep failed while dropping the gradient buffers: "
                                                 r"OSError: planted \(the trainer is left awake, as before the call\)"):
        memory.sleep()
    monkeypatch.undo()
    assert not memory.asleep and not memory.grads_offloaded
    assert all(torch.equal(p, snapshot[n]) for n, p in frozen.items())
    memory.check_awake("train_step")

    # the saver: pausing the parameters fails after the gradients went; they are given back
    saver = StandInSaver(fail_pause=PARAMS_TAG)
    chunk = _fake_ddp_chunk(8)
    saver.track(GRAD_BUFFER_TAG, [chunk.buffers[0].grad_data])
    memory = TrainerMemory(SaverRegions(saver), policy.model, DDPGradBuffers([chunk]), "cpu", rank=2)
    with pytest.raises(TrainerMemoryError, match="trainer rank 2: sleep failed while pausing the parameters: "
                                                 "RuntimeError: planted pause of 'default'"):
        memory.sleep()
    assert saver.calls == [("pause", GRAD_BUFFER_TAG), ("resume", GRAD_BUFFER_TAG)]
    assert not memory.asleep and not memory.grads_offloaded and torch.count_nonzero(chunk.buffers[0].grad_data) == 0


def test_the_worker_refuses_memory_steps_without_offload_train_and_model_calls_while_asleep(base):
    from k3.rl.trainer_worker import TrainerWorker

    spec = WorkerSpec(model_dir=str(base), lora=LORA, seed=3)
    resident = TrainerWorker(spec, GRPO, 64)
    assert resident.memory is None
    with pytest.raises(TrainerMemoryError, match=r"trainer rank 0: sleep\(\) without --offload-train: this trainer "
                                                 "keeps its memory resident"):
        resident.sleep()
    worker = TrainerWorker(WorkerSpec(model_dir=str(base), lora=LORA, seed=3, offload_train=True), GRPO, 64, rank=5)
    assert isinstance(worker.memory.regions, HostRegions)
    trajs = trajectories(worker.policy.model.config.vocab_size)
    assert [r["phase"] for r in worker.sleep()] == ["before_offload", "after_offload"]
    for call in (lambda: worker.log_probs(trajs), lambda: worker.train_step(trajs), worker.replica_digests,
                 lambda: worker.load_adapter("nowhere")):
        with pytest.raises(TrainerMemoryError, match="trainer rank 5: .* while the trainer is asleep: the loop must "
                                                     "wake_up the trainer first"):
            call()
    assert worker.clear_memory() == [] and worker.device_memory()["memory/physical_gb"] > 0
    assert [r["phase"] for r in worker.wake_up()] == ["before_wake_up", "after_wake_up"]
    assert len(worker.log_probs(trajs)) == len(trajs)


# ------------------------------------------------------------------------------------------------ the saver path
class StandInSaver:
    """torch_memory_saver's API on CPU. No allocator to capture: tensors are registered per tag with ``track``.
    ``pause`` empties their storages (memory a read must not touch, as an unmapped address), keeping a copy when
    the tag's region backs up; ``resume`` gives the storages back restored, or filled with 0xFF bytes (fresh memory
    holds garbage). Like the real one it ends the process on a second pause or a resume of what is not paused."""

    def __init__(self, fail_pause: str | None = None) -> None:
        self.tracked: dict[str, list[torch.Tensor]] = {PARAMS_TAG: [], GRAD_BUFFER_TAG: []}
        self.backs_up = {PARAMS_TAG: True, GRAD_BUFFER_TAG: False}
        self.backups: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail_pause = fail_pause

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool):
        self.calls.append(("region", tag))
        self.backs_up[tag] = enable_cpu_backup
        yield

    def track(self, tag: str, tensors) -> None:
        self.tracked[tag].extend(tensors)

    def _storages(self, tag):
        return list({t.untyped_storage()._cdata: t.untyped_storage() for t in self.tracked[tag]}.values())

    def pause(self, tag: str) -> None:
        if tag == self.fail_pause:
            raise RuntimeError(f"planted pause of {tag!r}")
        if tag in self.paused:
            raise SystemExit("torch_memory_saver: Cannot pause allocation that is not active")
        self.calls.append(("pause", tag))
        for s in self._storages(tag):
            self.backups[s._cdata] = (s.clone() if self.backs_up[tag] else None, s.nbytes())
            s.resize_(0)
        self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag not in self.paused:
            raise SystemExit("torch_memory_saver: resume of an allocation that is not paused")
        self.calls.append(("resume", tag))
        for s in self._storages(tag):
            copy, nbytes = self.backups.pop(s._cdata)
            s.resize_(nbytes)
            if copy is None:
                torch.empty(0, dtype=torch.uint8).set_(s).fill_(0xFF)
            else:
                s.copy_(copy)
        self.paused.discard(tag)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        copy, _ = self.backups.get(x.untyped_storage()._cdata, (None, 0))
        if copy is None:
            return None
        start = x.storage_offset() * x.element_size()
        raw = torch.empty(0, dtype=torch.uint8).set_(copy)[start:start + x.numel() * x.element_size()]
        return raw.view(x.dtype).view(x.shape)


def _fake_ddp_chunk(n: int):
    """What DDPGradBuffers needs of a megatron DDP chunk: its buffers' grad_data, zero_grad_buffer."""
    grad = torch.zeros(n)
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=grad)], expert_parallel_buffers=[],
                           zero_grad_buffer=lambda: grad.zero_())


def test_under_the_saver_the_regions_pause_in_the_recipes_order_and_the_export_reads_the_backups():
    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)), LORA)
    policy = PolicyTrainer(model, pad_id=0, grpo=GRPO, max_tokens_per_micro_batch=64)
    trajs = _trajs(policy)
    policy.train_step(trajs)  # B != 0: the export means something
    saver = StandInSaver()
    regions = SaverRegions(saver)
    with regions.params(), regions.grad_buffers():
        pass
    assert saver.calls == [("region", PARAMS_TAG), ("region", GRAD_BUFFER_TAG)]
    assert saver.backs_up == {PARAMS_TAG: True, GRAD_BUFFER_TAG: False}
    saver.calls.clear()
    chunk = _fake_ddp_chunk(16)
    chunk.buffers[0].grad_data.fill_(3.0)  # the last step's gradients
    saver.track(PARAMS_TAG, model.parameters())
    saver.track(GRAD_BUFFER_TAG, [chunk.buffers[0].grad_data])
    memory = TrainerMemory(regions, model, DDPGradBuffers([chunk]), "cpu")
    awake = _digests(model)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}

    memory.sleep()
    assert saver.calls == [("pause", GRAD_BUFFER_TAG), ("pause", PARAMS_TAG)]  # §5.1: grad_buffer, then default
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # unmapped: reading would fail
    with memory.readable():  # each adapter reads its backup
        assert _digests(model) == awake
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # back on the paused originals
    memory.sleep()
    memory.offload_grad_buffer()
    assert len(saver.calls) == 2  # idempotent: no second pause (the real saver would end the process)

    memory.wake_up()
    assert saver.calls[2:] == [("resume", PARAMS_TAG), ("resume", GRAD_BUFFER_TAG)]  # default, then grad_buffer
    assert all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())
    assert torch.count_nonzero(chunk.buffers[0].grad_data) == 0  # the fresh gradient memory was zeroed
    with memory.readable():  # awake: the parameters themselves
        assert _digests(model) == awake
    policy.train_step(trajs)


def test_the_gpu_extra_pins_the_saver_the_error_names():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert mr.SAVER_PIN in extras["gpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_reading_holds_the_peak_since_the_previous_reading():
    from k3.transport.device_memory import memory_reading

    memory_reading("start", "cuda")
    base = torch.cuda.memory_allocated() / 2**30
    scratch = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.25 GiB, freed before the reading
    del scratch
    first = memory_reading("after_scratch", "cuda")
    second = memory_reading("again", "cuda")
    assert first["memory/peak_allocated_gb"] >= base + 0.25
    assert second["memory/peak_allocated_gb"] < base + 0.01


def test_loading_the_saver_leaves_it_configurable_and_the_first_pause_retains_its_backups(monkeypatch):
    saver = LazySaver()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", SimpleNamespace(torch_memory_saver=saver))
    assert mr.load_memory_saver() is saver and saver._impl is None
    saver.hook_mode = "torch"  # what megatron-core's import does while the policy is built: must still be allowed
    regions = SaverRegions(mr.load_memory_saver())
    assert saver._impl is None and not saver.retained
    regions.pause(PARAMS_TAG)
    regions.pause(GRAD_BUFFER_TAG)
    assert saver._impl == {"hook_mode": "torch"} and saver.retained and saver.paused == [PARAMS_TAG, GRAD_BUFFER_TAG]
    with pytest.raises(AttributeError, match="_impl_ctor_kwargs"):  # the stand-in is faithful to the failure
        saver.hook_mode = "torch"
