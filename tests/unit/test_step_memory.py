"""What a profiled training step left allocated on the device (k3/rl/step_memory.py): the default pool's live blocks
the step made, summed by where they were allocated, read from an allocator snapshot. CPU: a snapshot in the layout
``torch.cuda.memory._snapshot()`` returns; on CUDA (``gpu``) the real recording."""

from __future__ import annotations

import json

import pytest
import torch

from k3.rl.step_memory import SHOWN, left_allocated, left_allocated_text, record_step_memory, write_step_memory

MB = 2**20


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


MOE = [_frame("/opt/venv/lib/python3.12/site-packages/torch/nn/functional.py", 10, "linear"),
       _frame("/root/repo/k3/megatron/moe.py", 120, "forward"),
       _frame("/root/repo/k3/rl/trainers/megatron.py", 300, "train_step")]
ROUTER = [_frame("/site/megatron/core/transformer/moe/router.py", 55, "routing"),
          _frame("/root/repo/k3/rl/step_memory.py", 90, "record_step_memory")]


def _block(size_mb: float, state: str = "active_allocated", frames=None) -> dict:
    b = {"size": int(size_mb * MB), "requested_size": int(size_mb * MB), "state": state}
    if frames is not None:
        b["frames"] = frames
    return b


def _snapshot() -> dict:
    return {"segments": [
        # the default pool: two blocks made by the MoE layer, one by the router, one from before the step, free space
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 100 * MB,
         "blocks": [_block(48, frames=MOE), _block(20, frames=MOE), _block(12, "inactive"), _block(20)]},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 20 * MB,
         "blocks": [_block(2, frames=ROUTER), _block(18, "inactive")]},
        # a private pool (the saver's region) and another device: not counted
        {"device": 0, "segment_pool_id": (1, 3), "total_size": 500 * MB, "blocks": [_block(500, frames=MOE)]},
        {"device": 1, "segment_pool_id": (0, 0), "total_size": 64 * MB, "blocks": [_block(64, frames=MOE)]},
    ]}


def test_the_default_pools_blocks_made_in_the_step_are_summed_by_the_nearest_frame_of_ours_or_a_library():
    found = left_allocated(_snapshot(), device_index=0)
    assert found["reserved_mb"] == 120.0
    assert found["live_mb"] == 48 + 20 + 20 + 2
    assert (found["made_in_step_mb"], found["made_in_step_blocks"]) == (70.0, 3)
    assert found["by_frame"] == [
        {"where": "k3/megatron/moe.py:120 (forward)", "mb": 68.0, "blocks": 2, "largest_mb": 48.0},
        # no frame of ours but the profiler's own: the library's
        {"where": "megatron/core/transformer/moe/router.py:55 (routing)", "mb": 2.0, "blocks": 1, "largest_mb": 2.0},
    ]


def test_beyond_the_shown_frames_the_rest_is_one_row_and_a_block_without_python_frames_says_so():
    blocks = [_block(float(i + 1), frames=[_frame(f"/r/k3/m{i}.py", i, "f")]) for i in range(SHOWN + 3)]
    blocks.append(_block(0.5, frames=[_frame("<built-in>", 0, "?")]))  # no Python file: unattributed
    found = left_allocated({"segments": [{"device": 0, "total_size": 10**9, "blocks": blocks}]})
    rows = found["by_frame"]
    assert len(rows) == SHOWN and rows[0]["where"] == f"k3/m{SHOWN + 2}.py:{SHOWN + 2} (f)"
    rest = rows[-1]
    assert rest["where"] == "(other frames)" and rest["blocks"] == 5  # frames 0-3 and the unattributed block
    assert rest["mb"] == pytest.approx(1 + 2 + 3 + 4 + 0.5) and rest["largest_mb"] == 4.0
    alone = left_allocated({"segments": [{"device": 0, "total_size": MB, "blocks": blocks[-1:]}]})
    assert alone["by_frame"][0]["where"] == "(no Python frame recorded)"


def test_the_record_is_written_as_json_and_text_headed_by_its_title(tmp_path):
    found = left_allocated(_snapshot())
    path = write_step_memory(found, tmp_path / "profile", "train_step_2_memory_rank0", "optimizer step 2")
    assert path == tmp_path / "profile" / "train_step_2_memory_rank0.txt"
    text = path.read_text()
    assert text == "optimizer step 2\n\n" + left_allocated_text(found)
    assert ("left allocated in the default pool after the step: 90.0 MiB live in 120.0 MiB of segments; 70.0 MiB in "
            "3 blocks made during the step") in text
    assert "      68.0       2      48.0  k3/megatron/moe.py:120 (forward)" in text
    assert json.loads((tmp_path / "profile" / "train_step_2_memory_rank0.json").read_text()) == found


def test_without_cuda_the_call_runs_and_nothing_is_recorded():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert record_step_memory(lambda: 41 + 1) == (42, None)


@pytest.mark.gpu
def test_on_cuda_a_tensor_kept_by_the_step_is_attributed_to_the_line_that_made_it():
    kept: list[torch.Tensor] = []

    def step() -> int:
        scratch = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")  # freed when the step returns
        kept.append(torch.empty(4 * MB, dtype=torch.uint8, device="cuda"))
        del scratch
        return 7

    result, found = record_step_memory(step)
    assert result == 7 and found is not None
    assert found["made_in_step_blocks"] == 1 and found["made_in_step_mb"] == pytest.approx(4.0)
    (row,) = found["by_frame"]
    assert row["where"].startswith("unit/test_step_memory.py:") and row["where"].endswith(" (step)"), row
    assert len(kept) == 1


class _Doubled(torch.autograd.Function):
    """A custom autograd Function, as fla's kernels and megatron's recompute are: its ``apply`` runs under the
    recorder (the H100 SystemError came from one, with the profiler's Python tracer on as well)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


@pytest.mark.gpu
def test_on_cuda_a_step_through_a_custom_autograd_function_records_and_its_gradient_is_exact():
    x = torch.ones(1024, 1024, device="cuda", requires_grad=True)

    def step() -> float:
        y = _Doubled.apply(x)
        y.sum().backward()
        return float(y.sum())

    result, found = record_step_memory(step)
    assert result == 2.0 * 1024 * 1024 and "error" not in found
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    # x.grad is the one block the step made and kept: 4 MiB, allocated by torch's autograd for the leaf
    assert found["made_in_step_mb"] == pytest.approx(4.0), found


class _Refusing:
    """Stands in for ``torch.cuda.memory``'s recorder, failing at the named call."""

    def __init__(self, fail_at: str) -> None:
        self.fail_at, self.calls = fail_at, []

    def record(self, enabled="all", **kwargs) -> None:
        what = "stop" if enabled is None else "start"
        self.calls.append(what)
        if what == self.fail_at:
            raise RuntimeError(f"no {what} here")

    def snapshot(self) -> dict:
        self.calls.append("snapshot")
        if self.fail_at == "snapshot":
            raise RuntimeError("no snapshot here")
        return _snapshot()


@pytest.mark.parametrize("fail_at, says", [
    ("start", "the allocator's history could not be recorded: RuntimeError: no start here"),
    ("snapshot", "the allocator could not be read: RuntimeError: no snapshot here"),
    ("stop", "the allocator's history could not be switched off: RuntimeError: no stop here"),
])
def test_a_recorder_that_fails_never_fails_the_step_and_the_profile_says_why(monkeypatch, fail_at, says):
    fake = _Refusing(fail_at)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.snapshot)
    result, found = record_step_memory(lambda: "stepped")
    assert result == "stepped" and found["error"] == says
    assert fake.calls[-1] == ("start" if fail_at == "start" else "stop")  # never left recording
    text = left_allocated_text(found)
    if fail_at == "stop":  # the blocks were read: they are shown, the error kept in the json
        assert text.startswith("left allocated in the default pool after the step: 90.0 MiB live")
    else:
        assert text == f"left allocated in the default pool after the step: not recorded ({says})\n"


def test_a_step_that_raises_propagates_with_the_history_switched_off(monkeypatch):
    fake = _Refusing("nothing")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)

    def step():
        raise FloatingPointError("gradient norm is nan")

    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        record_step_memory(step)
    assert fake.calls == ["start", "stop"]
