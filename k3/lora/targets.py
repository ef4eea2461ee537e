"""Where each LoRA target sits in the reference model: the modules it selects, checked against the schedule.

The targets, their HF modules, layers and export groups are rows of ``k3.settings.lora.LORA_TARGETS``;
``find_sites`` looks for them in a module tree, ``expected_sites`` derives them from a config's layer schedule,
and ``apply_lora`` requires the two to agree. A row's ``ModuleKind`` is mapped here to the module class it must
match (``nn.Linear``, or the stacked routed experts ``LatentExperts``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from k3.config import K3Config
from k3.model.moe import LatentExperts
from k3.settings.lora import LoRAConfigError, LoRATarget, ModuleKind, lora_target

__all__ = ["AdapterSite", "MODULE_CLASSES", "find_sites", "expected_sites"]

# What a target's module kind is in the reference model.
MODULE_CLASSES: dict[ModuleKind, type[nn.Module]] = {ModuleKind.LINEAR: nn.Linear,
                                                     ModuleKind.LATENT_EXPERTS: LatentExperts}


@dataclass(frozen=True)
class AdapterSite:
    """One module a target adapts: ``module`` is its path in the model (HF names without ``language_model.``)."""

    target: str
    group: str
    layer: int
    module: str


def _patterns(target: LoRATarget) -> list[tuple[re.Pattern[str], str]]:
    """``(module-path regex, export group)`` of every module the target may adapt, in any layer."""
    return [(re.compile(r"model\.layers\.(\d+)\." + re.escape(module)), block.group)
            for block in target.placement.blocks for module in target.hf_modules(block)]


def find_sites(model: nn.Module, targets: Sequence[str]) -> list[AdapterSite]:
    """Every module of ``model`` the (normalized) ``targets`` select, in model order.

    Raises ``LoRAConfigError`` if a target is unknown, matches no module, or matches a module of the wrong type.
    """
    modules = list(model.named_modules())
    sites: list[AdapterSite] = []
    for name_of_target in targets:
        target = lora_target(name_of_target)
        kind = MODULE_CLASSES[target.module_kind]
        patterns = _patterns(target)
        found = []
        for name, module in modules:
            for pattern, group in patterns:
                m = pattern.fullmatch(name)
                if m is None:
                    continue
                if not isinstance(module, kind):
                    raise LoRAConfigError(f"LoRA target {target.name!r} matches {name}, a {type(module).__name__}: "
                                          f"expected a {kind.__name__}")
                found.append(AdapterSite(target.name, group, int(m.group(1)), name))
        if not found:
            raise LoRAConfigError(f"LoRA target {target.name!r} matches no module of {type(model).__name__} "
                                  f"(looked for {[p.pattern for p, _ in patterns]})")
        sites += found
    order = {name: i for i, (name, _) in enumerate(modules)}
    return sorted(sites, key=lambda s: (order[s.module], s.target))


def expected_sites(cfg: K3Config, targets: Sequence[str]) -> list[AdapterSite]:
    """The sites the targets' placements give a model of ``cfg`` (the schedule, not the module tree)."""
    rows = [lora_target(t) for t in targets]
    sites: list[AdapterSite] = []
    for i in range(cfg.num_hidden_layers):
        for target in rows:
            for block in target.placement.blocks_at(cfg, i):
                sites += [AdapterSite(target.name, block.group, i, f"model.layers.{i}.{module}")
                          for module in target.hf_modules(block)]
    return sites
