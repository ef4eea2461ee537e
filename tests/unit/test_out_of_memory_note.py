"""A trainer rank that runs out of device memory says how full the device was (k3/transport/device_memory.py,
k3/rl/trainers/group.py). On the H200 the smoke-gpu run's first step failed with only NCCL's "Failed to CUDA calloc
async 4 bytes": nothing said that the device was full, nor how much the trainer held."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from k3.rl.trainers.group import TrainerRank
from k3.transport import device_memory
from k3.transport.device_memory import DeviceMemoryError, is_out_of_memory, memory_note

NCCL_TEXT = "DistBackendError: Failed to CUDA calloc async 4 bytes"


def _raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        return outer


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError(NCCL_TEXT), True),
    (RuntimeError("CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY"), True),
    (_raised_from(torch.OutOfMemoryError("no room")), True),
    (ValueError("input_ids: shape (2,): expected a [batch, seq] tensor"), False),
    (_raised_from(KeyError("lora_A")), False),
])
def test_allocation_failures_are_recognised_through_their_chain(error, expected):
    assert is_out_of_memory(error) is expected


def test_the_note_on_cpu_names_the_process_rss():
    note = memory_note("cpu")
    assert note.startswith("this process's RSS ") and note.endswith(" GiB")
    assert float(note.split()[3]) > 0


def test_a_note_that_cannot_read_the_device_says_so_instead_of_failing(monkeypatch):
    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(device_memory, "resolved_memory_device", broken)
    assert memory_note("cuda:0") == ("the memory of cuda:0 could not be read (RuntimeError: CUDA error: an illegal "
                                     "memory access was encountered)")


def _rank_raising(error: BaseException) -> TrainerRank:
    def train_step():
        raise error

    rank = TrainerRank(0, 1)
    rank.worker = SimpleNamespace(spec=SimpleNamespace(device="cpu"), train_step=train_step)
    return rank


def test_a_rank_out_of_memory_raises_the_error_with_the_device_s_state():
    nccl = RuntimeError(NCCL_TEXT)
    with pytest.raises(DeviceMemoryError, match=r"^out of device memory \(RuntimeError: DistBackendError: Failed to "
                                                r"CUDA calloc async 4 bytes\); this process's RSS [0-9.]+ GiB$") as got:
        _rank_raising(nccl).run("train_step")
    assert got.value.__cause__ is nccl


def test_other_errors_pass_through_unchanged():
    error = ValueError("bad trajectory")
    with pytest.raises(ValueError) as got:
        _rank_raising(error).run("train_step")
    assert got.value is error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_note_on_cuda_names_free_total_allocated_peak_and_reserved():
    held = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.25 GiB held while the note is taken
    note = memory_note("cuda")
    m = re.fullmatch(r"cuda:\d+ had ([0-9.]+) of ([0-9.]+) GiB free; this process allocated ([0-9.]+) GiB \(peak "
                     r"([0-9.]+) since its last memory reading\), reserved ([0-9.]+) GiB", note)
    assert m is not None, note
    free, total, allocated, peak, reserved = map(float, m.groups())
    assert 0 <= free <= total
    assert allocated == pytest.approx(torch.cuda.memory_allocated() / 2**30, abs=0.006) and allocated >= 0.25
    assert allocated <= peak + 0.006 and allocated <= reserved + 0.006
    del held
