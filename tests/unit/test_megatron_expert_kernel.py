"""The Megatron backend's routed-expert adapters on either kernel (``expert_lora_kernel``): ``torch`` (the delta
from torch's grouped GEMM, added by the base) or ``triton`` (the Triton kernels add it into the base's output,
``k3/kernels/expert_lora/``). One rank, no process group: the adapters only need the TP/EP sizes and ranks.

The ``triton`` parity tests run on the CPU under Triton's interpreter (``make test-interpret``: its own venv with
triton 3.6 and megatron-core) and skip in the project's venv, which has no Triton; ``test_lora_grouped.py`` runs
the same kernels compiled on CUDA. Tolerances: fp32 both ways, so forward and gradients agree to summation order
(1e-5 relative).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from k3.kernels import availability
from k3.kernels.expert_lora import function
from k3.kernels.expert_lora.triton import DEFAULT_BLOCKS, cpu_interpreter_problem
from k3.settings.lora import LoRAConfig

pytest.importorskip("megatron.core", reason="megatron-core is not installed (a GPU lease carries it as a wheel)")
from k3.megatron.linears import GroupedExpertLinear  # noqa: E402
from k3.megatron.lora import ExpertFc1LoRA, ExpertFc2LoRA, ParallelContext, apply_megatron_lora  # noqa: E402

COUNTS = [0, 1, 37, 16, 5, 0, 2]  # experts with 0 and 1 rows, several 16-row tiles, 61 rows
E, LT, FI, RANK = len(COUNTS), 16, 12, 3
REL = 1e-5

_PROBLEM = cpu_interpreter_problem()
needs_interpreter = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")
needs_cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and availability.triton_available()
                                            and not availability.INTERPRETING),
                                       reason="needs a CUDA device and Triton (compiled, TRITON_INTERPRET unset)")


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _linear(which: str, kernel: str = "torch", dropout: float = 0.0, seed: int = 0) -> GroupedExpertLinear:
    """fc1 ``[E, 2F, Lt]`` or fc2 ``[E, Lt, F]`` with an adapter whose B factors are non-zero."""
    torch.manual_seed(seed)
    config = SimpleNamespace(params_dtype=torch.float32, perform_initialization=True)
    ins, outs = (LT, 2 * FI) if which == "fc1" else (FI, LT)
    base = GroupedExpertLinear(E, ins, outs, config)
    base.weight.requires_grad_(False)
    ctx = ParallelContext(SimpleNamespace(tp=_OneRank(), ep=_OneRank()), sequence_parallel=False)
    adapter_cls = ExpertFc1LoRA if which == "fc1" else ExpertFc2LoRA
    base.lora = adapter_cls(base, num_experts=E, kernel=kernel, lora=LoRAConfig(rank=RANK, alpha=2.0 * RANK,
                            dropout=dropout), ctx=ctx, global_name=f"decoder.layers.1.mlp.experts.linear_{which}",
                            seed=seed)
    with torch.no_grad():
        for name, p in base.lora.named_parameters():
            if name.endswith("_B"):
                p.normal_()
    return base


def _forward_backward(linear: GroupedExpertLinear, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = linear(x, torch.tensor(COUNTS, device=x.device))
    names = [n for n, _ in linear.lora.named_parameters()]
    grads = torch.autograd.grad(out, [x, *linear.lora.parameters()], dy)
    return out.detach(), dict(zip(["x", *names], grads))


def _inputs(which: str):
    gen = torch.Generator().manual_seed(1)
    rows = sum(COUNTS)
    ins, outs = (LT, 2 * FI) if which == "fc1" else (FI, LT)
    return torch.randn(rows, ins, generator=gen), torch.randn(rows, outs, generator=gen)


# ------------------------------------------------------------------------------------------------ no Triton needed
def test_unknown_kernel_is_refused_before_the_model_is_touched():
    with pytest.raises(ValueError, match="expert_lora_kernel='cuda': expected one of \\('auto', 'torch', 'triton'\\)"):
        _linear("fc1", kernel="cuda")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="expert_lora_kernel='cuda'"):
        apply_megatron_lora(model, LoRAConfig(rank=2, alpha=4), expert_lora_kernel="cuda")
    assert model.weight.requires_grad  # not frozen: refused first


@pytest.mark.parametrize("which", ["fc1", "fc2"])
def test_torch_kernel_adds_the_delta_after_the_base_and_never_calls_the_kernels(monkeypatch, which):
    from k3.kernels.grouped_mm import grouped_mm_reference

    def boom(*a, **k):
        raise AssertionError("the torch kernel called a Triton wrapper")

    monkeypatch.setattr(function, "lora_fc1", boom)
    monkeypatch.setattr(function, "lora_down", boom)
    linear = _linear(which)
    assert "kernel=torch" in repr(linear.lora)
    x, _ = _inputs(which)
    counts = torch.tensor(COUNTS)
    torch.testing.assert_close(linear(x, counts), grouped_mm_reference(x, linear.weight, counts)
                               + linear.lora(x, counts), rtol=REL, atol=REL)


def test_triton_where_it_cannot_run_says_so_at_the_forward(monkeypatch):
    monkeypatch.setattr(availability, "triton_available", lambda: True)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: False)
    linear = _linear("fc2", kernel="triton")
    x, _ = _inputs("fc2")
    with pytest.raises(ValueError, match="expert_lora_kernel='triton': the Triton kernels cannot run on cpu.*use "
                                         "expert_lora_kernel='torch'"):
        linear(x, torch.tensor(COUNTS))
    monkeypatch.setattr(availability, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="expert_lora_kernel='triton' needs Triton"):
        _linear("fc1", kernel="triton")


# ------------------------------------------------------------------------------------------------ interpreter
@needs_interpreter
@pytest.mark.parametrize("which", ["fc1", "fc2"])
def test_triton_kernel_equals_the_torch_kernel_forward_and_every_gradient(monkeypatch, which, device="cpu"):
    for kernel in ("expand", "contract", "weight_grad"):  # small tiles: several per expert, partial ones
        monkeypatch.setitem(DEFAULT_BLOCKS[kernel], "block_m", 16)
    plain = _linear(which).to(device)
    fast = copy.deepcopy(plain)
    fast.lora.kernel = "triton"
    calls = []
    for name in ("lora_fc1", "lora_down"):
        real = getattr(function, name)
        monkeypatch.setattr(function, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    x, dy = (t.to(device) for t in _inputs(which))
    got, want = _forward_backward(fast, x, dy), _forward_backward(plain, x, dy)
    assert calls == ["lora_fc1" if which == "fc1" else "lora_down"]  # the kernels ran, not the torch path
    torch.testing.assert_close(got[0], want[0], rtol=REL, atol=REL)
    assert set(got[1]) == set(want[1]) == {"x", *(n for n, _ in plain.lora.named_parameters())}
    for name, ref in want[1].items():
        torch.testing.assert_close(got[1][name], ref, rtol=REL, atol=REL * float(ref.abs().max()), msg=name)
    assert fast.weight.grad is None


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("which", ["fc1", "fc2"])
def test_cuda_triton_kernel_equals_the_torch_kernel_forward_and_every_gradient(monkeypatch, which):
    """The compiled kernels, fp32 with IEEE products (no TF32), against torch's fp32 grouped GEMM on CUDA."""
    test_triton_kernel_equals_the_torch_kernel_forward_and_every_gradient(monkeypatch, which, device="cuda")


@needs_interpreter
def test_triton_kernel_leaves_dropout_to_the_torch_path_while_training(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("dropout is applied by the torch path only")

    monkeypatch.setattr(function, "lora_fc1", boom)
    linear = _linear("fc1", kernel="triton", dropout=0.5)
    x, _ = _inputs("fc1")
    linear.train()
    linear(x, torch.tensor(COUNTS))  # the torch path: no kernel call
    linear.eval()
    with pytest.raises(AssertionError, match="torch path only"):
        linear(x, torch.tensor(COUNTS))  # no dropout at eval: the kernels run
