"""The megatron policy's sleep / wake_up on CPU (gloo, one process, tests/megatron_compat.py): the trainer's memory
regions (``k3.rl.trainers.memory_regions``) around megatron's DDP.

Worker (this file as a script, on one rank and on two data-parallel ranks): the tiny K3 as a BF16-layout HF
checkpoint, a megatron policy built inside the CPU regions. After a GRPO step it sleeps — the frozen base goes to its host backup, DDP's gradient buffers are resized
to 0 (megatron's own ``offload_grad_buffers``: every view kept) — exports its adapters while asleep, wakes (base
back, gradients zeroed) and takes a second step; then the same two steps are replayed from the same adapters and
optimizer state without the sleep. It also builds a DDP under the distributed optimizer inside two recording
regions (``k3.megatron.ddp_regions``): the gradient buffers in one, the parameter buffer moved to the other.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch
from layout_parity import trajectories
from tiny_checkpoint import write_tiny_checkpoint

RANK, ALPHA = 4, 8.0
MAX_TOKENS = 24


def _digests(policy, version: int) -> list[str]:
    from k3.lora.digest import chunk_digest

    return [chunk_digest(c.tensors) for c in policy.export_chunks(version)]


def _graph_left() -> dict:
    """What Python can still reach of a step's autograd graphs (the trainer then sleeps with all it holds)."""
    import gc

    gc.collect()
    objs = gc.get_objects()
    return {"tensors_with_graph": sum(1 for o in objs if issubclass(type(o), torch.Tensor) and o.grad_fn is not None),
            "function_contexts": sum(1 for o in objs if isinstance(o, torch.autograd.function.BackwardCFunction))}


def _worker(root: Path, device: str) -> dict:
    """``device`` cpu: the CPU regions under tests/megatron_compat.py; cuda: torch_memory_saver's regions, megatron's
    own CUDA paths."""
    import os

    if device == "cpu":
        import megatron_compat

        megatron_compat.install()
    from k3.lora import LoRAConfig
    from k3.megatron.lora import gather_lora, load_lora
    from k3.rl.grpo import GRPOConfig
    from k3.rl.trainers.megatron import build_megatron_policy
    from k3.rl.trainers.memory_regions import TrainerMemory, resident_bytes, trainer_regions

    base = write_tiny_checkpoint(root / f"rank{os.environ.get('RANK', '0')}")  # the same bytes, no shared writes
    regions = trainer_regions(True, device)
    policy = build_megatron_policy(base, LoRAConfig(rank=RANK, alpha=ALPHA), pad_id=0,
                                   grpo=GRPOConfig(lr=5e-3, weight_decay=0.1, clip_grad=1.0),
                                   max_tokens_per_micro_batch=MAX_TOKENS, seed=3, regions=regions)
    memory = TrainerMemory(regions, policy.model, policy.grad_buffers(), device, rank=0)
    trajs = trajectories(policy.cfg.vocab_size)
    for t, lp in zip(trajs, policy.log_probs(trajs)):
        t.old_log_probs = lp
    start_lora = gather_lora(policy.model)
    start_opt = io.BytesIO()
    torch.save(policy.optimizer_state(), start_opt)

    out: dict = {"step1": policy.train_step(trajs)}
    out["graph_after_step"] = _graph_left()
    out["export_awake"] = _digests(policy, 1)
    frozen = {n: p for n, p in policy.model.named_parameters() if not p.requires_grad}
    snapshot = {n: p.detach().clone() for n, p in frozen.items()}
    grad_views = policy.grad_buffers().tensors()
    out["frozen_bytes"] = resident_bytes(frozen.values())
    out["adapter_bytes"] = resident_bytes(p for p in policy.model.parameters() if p.requires_grad)
    out["grad_bytes"] = resident_bytes(grad_views)
    out["grads_nonzero_before"] = any(torch.count_nonzero(g) > 0 for g in grad_views)
    out["awake"] = memory.resident_bytes()
    out["sleep"] = memory.sleep()
    out["asleep"] = memory.resident_bytes()
    if device == "cpu":  # on CUDA the tensors keep their (paused) virtual memory
        out["frozen_emptied"] = all(p.numel() == 0 for p in frozen.values())
        out["grad_storage_asleep"] = sum(g.untyped_storage().nbytes() for g in grad_views)
    with memory.readable():
        out["export_asleep"] = _digests(policy, 1)
    out["wake"] = memory.wake_up()
    out["woken"] = memory.resident_bytes()
    out["frozen_back"] = all(torch.equal(p, snapshot[n]) for n, p in frozen.items())
    out["grads_zero_after_wake"] = all(torch.count_nonzero(g) == 0 for g in policy.grad_buffers().tensors())
    out["step2"] = policy.train_step(trajs)
    slept_lora = gather_lora(policy.model)

    # the same two steps from the same start, without the sleep
    load_lora(policy.model, start_lora)
    policy.load_optimizer_state(torch.load(io.BytesIO(start_opt.getvalue()), weights_only=False))
    out["plain"] = [policy.train_step(trajs), policy.train_step(trajs)]
    out["same_adapters"] = all(torch.equal(v, slept_lora[k]) for k, v in gather_lora(policy.model).items())
    out["ddp_regions"] = _ddp_regions(policy.trainer.config)
    policy.close()
    return out


def _ddp_regions(config) -> dict:
    """A DDP under the distributed optimizer built inside recording regions: where its buffers end up."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from k3.megatron.ddp_regions import build_ddp_in_regions

    entered: list[str] = []

    def region(name):
        @contextlib.contextmanager
        def enter():
            entered.append(name)
            yield
        return enter

    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    if torch.cuda.is_available():  # the CUDA worker (the CPU one's torch has no CUDA)
        module = module.cuda()
    module[0].weight.requires_grad_(False)
    trainable = [p for p in module.parameters() if p.requires_grad]
    values = [p.detach().clone() for p in trainable]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    built: list[int] = []  # the storage megatron gave param_data

    def make():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
        built.append(ddp.buffers[0].param_data.untyped_storage()._cdata)
        return ddp

    ddp = build_ddp_in_regions(make, region("params"), region("grads"))
    (buffer,) = ddp.buffers
    home = buffer.param_data.untyped_storage()._cdata
    grads = buffer.grad_data.untyped_storage()._cdata
    return {
        "entered": entered,
        "moved": home != built[0],
        "params_in_new_buffer": all(p.untyped_storage()._cdata == home for p in trainable),
        "buckets_in_new_buffer": all(b.param_data.untyped_storage()._cdata == home for b in buffer.buckets),
        "values_kept": all(torch.equal(p, v) for p, v in zip(trainable, values)),
        "main_grads_in_grad_buffer": all(p.main_grad.untyped_storage()._cdata == grads for p in trainable),
        "frozen_untouched": module[0].weight.untyped_storage()._cdata not in (home, grads),
        "no_param_data_without_distributed_optimizer": _plain_ddp_has_no_param_data(config),
    }


def _plain_ddp_has_no_param_data(config) -> bool:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from k3.megatron.ddp_regions import rehome_param_data

    module = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=module)
    return ddp.buffers[0].param_data is None and rehome_param_data(ddp, contextlib.nullcontext) == 0


if __name__ == "__main__":
    from megatron_compat import save_result

    save_result(_worker(Path(sys.argv[1]), sys.argv[2]), sys.argv[1])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module", params=[1, 2], ids=["one-rank", "dp2"])
def result(request, tmp_path_factory) -> dict:
    """One rank, and two data-parallel gloo ranks (each sleeps and wakes; rank 0's results)."""
    from megatron_compat import worker_result

    tmp = tmp_path_factory.mktemp("megatron_sleep")
    return worker_result([__file__, str(tmp), "cpu"], tmp, nproc=request.param)


def test_sleep_moves_the_frozen_base_and_drops_the_ddp_gradient_buffers(result):
    assert result["grads_nonzero_before"] and result["grad_bytes"] > 0 and result["frozen_bytes"] > 0
    assert result["awake"] == result["frozen_bytes"] + result["adapter_bytes"] + result["grad_bytes"]
    # asleep: only the adapters are resident; the gradient buffers' storage is 0 bytes, its views kept
    assert result["asleep"] == result["adapter_bytes"] and result["grad_storage_asleep"] == 0
    assert result["frozen_emptied"]
    assert [r["phase"] for r in result["sleep"]] == ["before_offload", "after_offload"]
    assert [r["phase"] for r in result["wake"]] == ["before_wake_up", "after_wake_up"]
    assert round(result["sleep"][1]["memory/allocated_gb"] * 2**30) == result["adapter_bytes"]


def test_nothing_of_the_steps_autograd_graph_outlives_it(result):
    """megatron's token dispatcher kept its last call's routing probabilities, and with them the graph back to the
    last micro-batch's layer inputs, until its next call (k3.megatron.moe.release_dispatch_state)."""
    assert result["graph_after_step"] == {"tensors_with_graph": 0, "function_contexts": 0}


def test_wake_up_brings_the_base_back_bit_for_bit_with_zeroed_gradients(result):
    assert result["frozen_back"] and result["grads_zero_after_wake"] and result["woken"] == result["awake"]


def test_the_export_while_asleep_equals_the_export_awake(result):
    assert result["export_asleep"] == result["export_awake"] and len(result["export_awake"]) > 0


def test_training_after_the_wake_equals_training_without_sleep(result):
    assert result["plain"] == [result["step1"], result["step2"]]
    assert result["same_adapters"]


def test_ddp_gradient_buffers_in_their_region_and_the_parameter_buffer_in_the_other(result):
    ddp = result["ddp_regions"]
    assert ddp["entered"] == ["grads", "params"]  # DDP built inside the gradient region, then param_data moved
    assert all(ddp[k] for k in ("moved", "params_in_new_buffer", "buckets_in_new_buffer", "values_kept",
                                "main_grads_in_grad_buffer", "frozen_untouched",
                                "no_param_data_without_distributed_optimizer")), ddp


@pytest.mark.gpu
def test_on_cuda_under_torch_memory_saver(tmp_path):
    """The same on one GPU with the real saver: allocated stays while the trainer sleeps (paused memory keeps its
    virtual allocation), the base comes back bit for bit, the export reads the backups, training is unchanged."""
    pytest.importorskip("torch_memory_saver")
    from megatron_compat import worker_result

    got = worker_result([__file__, str(tmp_path), "cuda"], tmp_path)
    before, after = got["sleep"]
    assert after["memory/allocated_gb"] == before["memory/allocated_gb"]
    assert after["memory/physical_gb"] < before["memory/physical_gb"]
    assert got["frozen_back"] and got["grads_zero_after_wake"]
    assert got["export_asleep"] == got["export_awake"]
    assert got["plain"] == [got["step1"], got["step2"]] and got["same_adapters"]
    assert got["graph_after_step"] == {"tensors_with_graph": 0, "function_contexts": 0}


def test_a_shared_param_and_grad_buffer_is_refused_naming_the_way_out():
    from types import SimpleNamespace

    from k3.megatron.ddp_regions import rehome_param_data

    buffer = SimpleNamespace(param_data=torch.zeros(8), shared_buffer=torch.zeros(16), buckets=[], params=[])
    ddp = SimpleNamespace(buffers=[buffer], expert_parallel_buffers=[])
    with pytest.raises(ValueError, match=r"one shared buffer \(MXFP8 parameters\).*--no-offload-train"):
        rehome_param_data(ddp, contextlib.nullcontext)
    assert buffer.param_data.numel() == 8  # nothing moved
