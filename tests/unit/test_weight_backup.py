"""The embedded engine's host copy of its weights while released (k3/rollout/embedded/weight_backup.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3.rollout.embedded.weight_backup import WeightBackup


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4, bias=False)).to(device=device, dtype=torch.bfloat16)
    m[1].weight.requires_grad_(False)
    return m


def _round_trip(device: str) -> None:
    model = _model(device)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in want.values())
    backup = WeightBackup(torch.device(device))
    for cycle in range(2):  # the second release reuses the first one's host buffers
        backup.save(model)
        assert all(p.numel() == 0 and p.device.type == device for p in model.parameters())
        assert backup.host_bytes() == nbytes
        backup.restore(model)
        for n, p in model.named_parameters():
            assert p.device.type == device and p.dtype == torch.bfloat16
            assert torch.equal(p, want[n]), (cycle, n)
        with torch.no_grad():  # what changed on the device between releases is what the next release keeps
            model[0].bias.add_(1)
            want["0.bias"] = model[0].bias.detach().clone()
    model(torch.ones(2, 8, device=device, dtype=torch.bfloat16))  # the restored parameters are usable


def test_cpu_round_trip_is_bit_exact_and_empties_the_parameters():
    _round_trip("cpu")


def test_host_bytes_on_cpu_are_zero_once_restored():
    model = _model("cpu")
    backup = WeightBackup(torch.device("cpu"))
    backup.save(model)
    backup.restore(model)
    assert backup.host_bytes() == 0  # a CPU engine's "backup" is the parameters' own storage


def test_save_twice_and_restore_without_save_are_refused():
    model = _model("cpu")
    backup = WeightBackup(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="nothing was saved"):
        backup.restore(model)
    backup.save(model)
    with pytest.raises(RuntimeError, match="already saved"):
        backup.save(model)


def test_restore_into_a_model_with_a_new_parameter_names_it():
    model = _model("cpu")
    backup = WeightBackup(torch.device("cpu"))
    backup.save(model)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"no host copy of \['extra.weight', 'extra.bias'\] \(2 parameters\)"):
        backup.restore(model)


@pytest.mark.gpu
def test_cuda_round_trip_through_pinned_buffers_is_bit_exact():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _round_trip("cuda")
    model = _model("cuda")
    backup = WeightBackup(torch.device("cuda"))
    backup.save(model)
    assert all(t.is_pinned() for t in backup._host.values())
    backup.restore(model)
