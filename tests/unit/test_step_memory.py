"""What a training step left allocated on the device (k3/rl/step_memory.py): the default pool's live blocks, each
charged to the holder of a tensor Python can reach inside it. CPU: snapshots in the layout
``torch.cuda.memory._snapshot()`` returns, and holders of real CPU tensors; on CUDA (``gpu``) the real reading."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from k3.rl.step_memory import (LOOKUP_STOPPED, NOT_LOOKED_UP, OUTSIDE_PYTHON, SHOWN, TensorView, holder_of,
                               left_allocated, left_allocated_text, live_blocks, reachable_tensors,
                               record_step_memory, write_step_memory)

MB = 2**20


def _block(size_mb: float, state: str = "active_allocated", address: int | None = None) -> dict:
    b = {"size": int(size_mb * MB), "requested_size": int(size_mb * MB), "state": state}
    if address is not None:
        b["address"] = address
    return b


def _snapshot() -> dict:
    return {"segments": [
        # the default pool: blocks without their own address sit one after the other from the segment's
        {"device": 0, "segment_pool_id": (0, 0), "address": 1000 * MB, "total_size": 100 * MB,
         "blocks": [_block(48), _block(20), _block(12, "inactive"), _block(20)]},
        {"device": 0, "segment_pool_id": (0, 0), "address": 2000 * MB, "total_size": 20 * MB,
         "blocks": [_block(2, address=2000 * MB), _block(18, "inactive", address=2002 * MB)]},
        # a private pool (the saver's region) and another device: not counted
        {"device": 0, "segment_pool_id": (1, 3), "address": 3000 * MB, "total_size": 500 * MB,
         "blocks": [_block(500)]},
        {"device": 1, "segment_pool_id": (0, 0), "address": 4000 * MB, "total_size": 64 * MB,
         "blocks": [_block(64)]},
    ]}


def test_live_blocks_are_the_default_pools_on_the_device_with_their_addresses():
    blocks, reserved = live_blocks(_snapshot(), device_index=0)
    assert blocks == [(1000 * MB, 48 * MB), (1048 * MB, 20 * MB), (1080 * MB, 20 * MB), (2000 * MB, 2 * MB)]
    assert reserved == 120 * MB
    assert live_blocks(_snapshot(), device_index=1) == ([(4000 * MB, 64 * MB)], 64 * MB)


def test_each_block_is_charged_to_the_holder_of_the_first_tensor_inside_it_and_the_rest_is_outside_python():
    blocks, reserved = live_blocks(_snapshot())
    views = [TensorView(1000 * MB + 4096, MB, "Policy.cache", "[1, 7168] bfloat16"),  # inside the first block
             TensorView(1000 * MB, 48 * MB, "Policy.cache", "[3533, 7168] bfloat16"),  # its start: the same block
             TensorView(1080 * MB, 20 * MB, "list of 2", "[10] float32"),
             TensorView(5000 * MB, MB, "Elsewhere.x", "[1] float32")]  # in no live block: not counted
    before = {1080 * MB, 2000 * MB}  # live before the step
    found = left_allocated(blocks, reserved, views, before)
    assert (found["reserved_mb"], found["live_mb"]) == (120.0, 90.0)
    assert (found["made_in_step_mb"], found["made_in_step_blocks"]) == (68.0, 2)
    assert found["by_holder"] == [
        {"holder": "Policy.cache", "what": "[3533, 7168] bfloat16", "mb": 48.0, "blocks": 1, "largest_mb": 48.0,
         "in_step_mb": 48.0},
        {"holder": OUTSIDE_PYTHON, "what": "", "mb": 22.0, "blocks": 2, "largest_mb": 20.0, "in_step_mb": 20.0},
        {"holder": "list of 2", "what": "[10] float32", "mb": 20.0, "blocks": 1, "largest_mb": 20.0,
         "in_step_mb": 0.0},
    ]
    text = left_allocated_text(found)
    assert text.startswith("left allocated in the default pool after the step: 90.0 MiB live in 120.0 MiB of "
                           "segments; 68.0 MiB in 2 blocks made during the step. By who holds them:")
    assert "      48.0     48.0       1      48.0  Policy.cache: [3533, 7168] bfloat16\n" in text
    assert f"      22.0     20.0       2      20.0  {OUTSIDE_PYTHON}\n" in text


def test_blocks_whose_tensors_were_not_searched_say_so_unless_a_tensor_was_found_in_them():
    blocks, reserved = live_blocks(_snapshot())
    views = [TensorView(2000 * MB, 2 * MB, "Adam.state", "[2] float32")]
    found = left_allocated(blocks, reserved, views, looked_up={1000 * MB})
    assert [(r["holder"], r["mb"]) for r in found["by_holder"]] == [
        (OUTSIDE_PYTHON, 48.0), (NOT_LOOKED_UP, 40.0), ("Adam.state", 2.0)]


def test_beyond_the_shown_holders_the_rest_is_one_row():
    blocks = [(k * 100 * MB, (k + 1) * MB) for k in range(SHOWN + 3)]
    views = [TensorView(a, s, f"H{a // MB:05d}", "[1] float32") for a, s in blocks]
    found = left_allocated(blocks, 10**9, views)
    rows = found["by_holder"]
    assert len(rows) == SHOWN and rows[0]["mb"] == SHOWN + 3 and rows[-1]["holder"] == "(other holders)"
    assert rows[-1]["blocks"] == 4 and rows[-1]["mb"] == 1 + 2 + 3 + 4 and rows[-1]["largest_mb"] == 4.0
    assert found["made_in_step_blocks"] == SHOWN + 3  # nothing was live before


class Keeper:
    pass


def test_holders_are_named_by_the_object_attribute_buffer_or_container_that_references_them():
    kept = Keeper()
    kept.cache = torch.zeros(3)
    assert holder_of(kept.cache, ignore=[vars(kept)]) == OUTSIDE_PYTHON  # its one holder ignored
    assert holder_of(kept.cache) == "Keeper.cache"
    norm = nn.Module()
    norm.register_buffer("scale", torch.ones(2))
    assert holder_of(norm.scale) == "Module._buffers['scale']"
    lin = nn.Linear(2, 2, bias=False)
    seen = {lin.weight}  # a container that holds it too: the module's name for it wins
    assert holder_of(lin.weight) == "Linear._parameters['weight']" and len(seen) == 1
    held = {torch.zeros(1)}  # a container with no name of its own (a running function's local)
    assert holder_of(next(iter(held))) == "set of 1"
    adam = torch.optim.Adam([nn.Parameter(torch.ones(2))])
    adam.param_groups[0]["params"][0].grad = torch.ones(2)
    adam.step()
    (state,) = adam.state.values()
    assert holder_of(state["exp_avg"], ignore=[vars()]) == "Adam.state[Parameter]['exp_avg']"
    keyed = Keeper()
    keyed.buckets = {torch.zeros(1): "bucket 0"}
    assert holder_of(next(iter(keyed.buckets))) == "Keeper.buckets (a key)"
    keyed.owner = next(iter(keyed.buckets))  # held as a value too: that names it
    assert holder_of(keyed.owner) == "Keeper.owner"
    listed = [torch.zeros(1), 5]
    assert holder_of(listed[0]) == "list of 2"
    mapping = {"k": torch.zeros(1)}
    assert holder_of(mapping["k"]) == "dict['k']"

    def make():
        local = torch.zeros(4)
        return holder_of(local)
    assert make() == OUTSIDE_PYTHON  # a running function's frame is no object the collector sees


def test_reachable_tensors_within_the_blocks_come_with_their_holders_shapes_and_grads():
    kept = Keeper()
    kept.weight = torch.ones(2, 3, requires_grad=True)
    kept.weight.grad = torch.full((2, 3), 2.0)
    other = torch.zeros(5)
    within = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in (kept.weight, kept.weight.grad)]
    views = reachable_tensors("cpu", within)
    assert sorted((v.holder, v.what, v.nbytes) for v in views) == [
        ("Keeper.weight", "[2, 3] float32", 24), ("Keeper.weight.grad", "[2, 3] float32", 24)]
    assert other.untyped_storage().data_ptr() not in {v.ptr for v in views}


def test_one_tensor_per_block_is_looked_up_the_one_that_is_no_view_and_lookups_stop_at_their_budget():
    kept = Keeper()
    kept.flat = torch.zeros(64)
    kept.pieces = [kept.flat[i:i + 16] for i in range(0, 64, 16)]  # views into the same block, found first or not
    block = [(kept.flat.untyped_storage().data_ptr(), kept.flat.untyped_storage().nbytes())]
    (view,) = reachable_tensors("cpu", block)
    assert (view.holder, view.what, view.nbytes) == ("Keeper.flat", "[64] float32", 256)
    (stopped,) = reachable_tensors("cpu", block, budget_s=0.0)
    assert stopped.holder == LOOKUP_STOPPED and stopped.what == "[64] float32"


def test_the_record_is_written_as_json_and_text_headed_by_its_title(tmp_path):
    blocks, reserved = live_blocks(_snapshot())
    found = left_allocated(blocks, reserved, [])
    path = write_step_memory(found, tmp_path / "profile", "train_step_2_memory_rank0", "optimizer step 2")
    assert path == tmp_path / "profile" / "train_step_2_memory_rank0.txt"
    assert path.read_text() == "optimizer step 2\n\n" + left_allocated_text(found)
    assert json.loads((tmp_path / "profile" / "train_step_2_memory_rank0.json").read_text()) == found


def test_without_cuda_the_call_runs_and_nothing_is_recorded():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert record_step_memory(lambda: 41 + 1) == (42, None)


@pytest.mark.parametrize("fail_at", [1, 2])
def test_an_allocator_that_cannot_be_read_never_fails_the_step_and_the_record_says_why(monkeypatch, fail_at):
    calls = []

    def snapshot():
        calls.append("snapshot")
        if len(calls) == fail_at:
            raise RuntimeError("no snapshot here")
        return _snapshot()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
    result, found = record_step_memory(lambda: "stepped")
    assert result == "stepped"
    assert found == {"error": "the allocator could not be read: RuntimeError: no snapshot here"}
    assert left_allocated_text(found) == ("left allocated in the default pool after the step: not recorded (the "
                                          "allocator could not be read: RuntimeError: no snapshot here)\n")


def test_a_step_that_raises_propagates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", _snapshot)

    def step():
        raise FloatingPointError("gradient norm is nan")

    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        record_step_memory(step)


class _Doubled(torch.autograd.Function):
    """A custom autograd Function, as fla's kernels and megatron's recompute are."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


@pytest.mark.gpu
def test_on_cuda_what_the_step_keeps_is_charged_to_its_holder_and_a_dropped_graph_leaves_nothing():
    kept = Keeper()
    x = torch.ones(1024, 1024, device="cuda", requires_grad=True)  # 4 MiB, live before the step

    def step() -> float:
        scratch = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")  # freed when the step returns
        kept.cache = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        y = _Doubled.apply(x)
        y.sum().backward()
        del scratch
        return float(y.sum())

    result, found = record_step_memory(step)
    assert result == 2.0 * 1024 * 1024 and "error" not in found, found
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    rows = {r["holder"]: r for r in found["by_holder"]}
    assert rows["Keeper.cache"]["what"] == f"[{4 * MB}] uint8" and rows["Keeper.cache"]["in_step_mb"] == 4.0
    grad = next(r for h, r in rows.items() if h.endswith(".grad"))
    assert grad["what"] == "[1024, 1024] float32" and grad["in_step_mb"] == 4.0
    assert found["made_in_step_mb"] == pytest.approx(8.0, abs=0.1), found  # the cache and x.grad
