"""apply_lora: freeze the model, then attach adapters at the configured targets (``k3/settings/lora.py``).

Linear targets get a ``LoRALinear`` per module; the modules of a target Megatron fuses into one linear (fc1's gate
and up) share one ``lora_A``. The routed experts get one ``LoRALatentExperts`` with the expert targets' factors.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from torch import nn

from k3.config import K3Config
from k3.kernels.expert_lora.function import check_kernel_choice
from k3.lora.experts import LoRALatentExperts
from k3.lora.linear import LoRALinear, new_lora_A
from k3.lora.targets import AdapterSite, expected_sites, find_sites
from k3.settings.lora import LoRAConfig, LoRAConfigError, ModuleKind, ParallelStyle, lora_target

__all__ = ["apply_lora", "lora_modules", "lora_parameter_counts", "has_lora"]

log = logging.getLogger(__name__)


def has_lora(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries an adapter."""
    return any(isinstance(m, (LoRALinear, LoRALatentExperts)) for m in model.modules())


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear | LoRALatentExperts]]:
    """``(path, module)`` of every adapted module, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRALatentExperts))]


def lora_parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (a tied Parameter counts once)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def apply_lora(model: nn.Module, config: LoRAConfig, expert_lora_kernel: str = "torch") -> nn.Module:
    """Freeze every parameter of ``model``, then attach adapters at ``config.target_modules``; returns ``model``.

    ``expert_lora_kernel``: ``"torch"``, ``"triton"`` or ``"auto"``, how the routed experts' adapters run their
    rank-r grouped GEMMs (``LoRALatentExperts(lora_impl=...)``; the same adapters and math either way).

    The model is changed in place (modules replaced by ``LoRALinear`` / ``LoRALatentExperts`` that keep the
    base weights and their state-dict names) and remembers ``config`` as ``model.lora_config``. Adapters
    take the device and dtype of the weight they adapt (this also works under ``torch.device("meta")``).

    Raises ``LoRAConfigError`` if a target matches no module, or if the modules found disagree with the
    layer schedule of ``model.config`` (e.g. a q_a_proj on a KDA layer); ``TypeError`` if LoRA is already on;
    ``ValueError`` for an unknown ``expert_lora_kernel`` or ``"triton"`` without Triton. Nothing is changed then.
    """
    if not isinstance(config, LoRAConfig):
        raise TypeError(f"apply_lora: config is a {type(config).__name__}, expected LoRAConfig")
    check_kernel_choice(expert_lora_kernel, flag="expert_lora_kernel")
    if has_lora(model):
        raise TypeError("apply_lora: the model already carries LoRA adapters")
    sites = find_sites(model, config.target_modules)
    cfg = getattr(model, "config", None)
    if isinstance(cfg, K3Config):
        _check_coverage(sites, expected_sites(cfg, config.target_modules))
    for p in model.parameters():
        p.requires_grad_(False)

    r, alpha, p_drop = config.rank, config.alpha, config.dropout
    fused_A: dict[tuple[str, str], nn.Parameter] = {}  # (target, block path): one A tied between its modules
    expert_styles: dict[str, set[ParallelStyle]] = defaultdict(set)
    for site in sites:
        target = lora_target(site.target)
        if target.module_kind is ModuleKind.LATENT_EXPERTS:
            expert_styles[site.module].add(target.style)
            continue
        parent, leaf = _parent(model, site.module)
        base = getattr(parent, leaf)
        shared = None
        if target.fused:
            key = (target.name, site.module.rsplit(".", 1)[0])
            if key not in fused_A:
                fused_A[key] = new_lora_A(r, base.in_features, like=base.weight)
            shared = fused_A[key]
        setattr(parent, leaf, LoRALinear(base, r, alpha, p_drop, shared_A=shared))
    for path, styles in expert_styles.items():
        parent, leaf = _parent(model, path)
        base = getattr(parent, leaf)
        setattr(parent, leaf, LoRALatentExperts(base, r, alpha, p_drop, fc1=ParallelStyle.EXPERT_FC1 in styles,
                                                fc2=ParallelStyle.EXPERT_FC2 in styles,
                                                lora_impl=expert_lora_kernel))
    model.lora_config = config
    trainable, total = lora_parameter_counts(model)
    log.info("LoRA r=%d alpha=%g on %d modules: trainable %d / total %d parameters (%.6f%%)", r, alpha,
             len(lora_modules(model)), trainable, total, 100.0 * trainable / max(total, 1))
    return model


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, leaf = path.rpartition(".")
    return (model.get_submodule(head) if head else model), leaf


def _check_coverage(found: list[AdapterSite], expected: list[AdapterSite]) -> None:
    key = lambda s: (s.target, s.module)  # noqa: E731
    have, want = {key(s) for s in found}, {key(s) for s in expected}
    if have != want:
        extra, missing = sorted(have - want), sorted(want - have)
        raise LoRAConfigError(
            "LoRA targets do not match the model's layer schedule (model.config): "
            + (f"{len(missing)} expected but absent, e.g. {missing[:3]}; " if missing else "")
            + (f"{len(extra)} present but not expected, e.g. {extra[:3]}" if extra else "")
        )
