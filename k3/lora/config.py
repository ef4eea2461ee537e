"""LoRAConfig: rank, alpha, dropout and the recipe's target patterns.

The defaults are the public K3 launcher's (rank 16, alpha 32, dropout 0, all seven targets); the validated run
used rank 32 / alpha 64. Targets are the recipe's Megatron names (``decoder.layers.*.`` prefix optional); how
each one maps onto our HF-named modules is in ``k3/lora/targets.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoRAConfig", "RECIPE_TARGETS", "LoRAConfigError"]

# The launcher default (K3:scripts/run_kimi_k3_lora.py), without the ``decoder.layers.*.`` prefix.
RECIPE_TARGETS: tuple[str, ...] = (
    "self_attention.o_proj",
    "self_attention.q_a_proj",
    "self_attention.kv_a_proj_with_mqa",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.experts.linear_fc1",
    "mlp.experts.linear_fc2",
)

_MEGATRON_PREFIX = "decoder.layers.*."


class LoRAConfigError(ValueError):
    """A LoRA setting is out of range, or a target is unknown or matches no module of the model."""


def normalize_target(name: str) -> str:
    """``decoder.layers.*.mlp.linear_fc1`` -> ``mlp.linear_fc1``; unknown names raise."""
    short = name[len(_MEGATRON_PREFIX):] if name.startswith(_MEGATRON_PREFIX) else name
    if short not in RECIPE_TARGETS:
        raise LoRAConfigError(
            f"LoRA target {name!r} is unknown: expected one of {list(RECIPE_TARGETS)} "
            f"(optionally prefixed {_MEGATRON_PREFIX!r})"
        )
    return short


@dataclass(frozen=True)
class LoRAConfig:
    """Adapter hyper-parameters.

    Attributes:
        rank: adapter rank r (> 0).
        alpha: ``lora_alpha``; the adapter output is scaled by ``alpha / rank``.
        dropout: dropout probability on the adapter input, applied in training mode only (0 <= p < 1).
        target_modules: recipe target names (see ``RECIPE_TARGETS``); normalized to the short form, in recipe
            order, duplicates removed.
        experts_shared_outer: the routed-expert layout. Only the shared-outer layout exists (the recipe makes
            ``--experts-shared-outer-loras`` mandatory, and it is SGLang's serving contract), so this must be True.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=RECIPE_TARGETS)
    experts_shared_outer: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAConfigError(f"LoRAConfig.rank={self.rank!r}: expected an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LoRAConfigError(f"LoRAConfig.alpha={self.alpha!r}: expected a number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoRAConfigError(f"LoRAConfig.dropout={self.dropout!r}: expected 0 <= dropout < 1")
        if isinstance(self.target_modules, str):
            raise LoRAConfigError(
                f"LoRAConfig.target_modules={self.target_modules!r}: expected a list of target names, not a string"
            )
        if not self.target_modules:
            raise LoRAConfigError("LoRAConfig.target_modules is empty: expected at least one target")
        given = {normalize_target(t) for t in self.target_modules}
        object.__setattr__(self, "target_modules", tuple(t for t in RECIPE_TARGETS if t in given))
        if self.experts_shared_outer is not True:
            raise LoRAConfigError(
                "LoRAConfig.experts_shared_outer=False: only the shared-outer expert layout is implemented "
                "(the recipe requires --experts-shared-outer-loras)"
            )

    @property
    def scale(self) -> float:
        """The factor on the adapter delta, ``alpha / rank``."""
        return float(self.alpha) / self.rank

    def hf_target_modules(self) -> list[str]:
        """HF module names the serving side targets (the list miles sends to SGLang), in a stable order."""
        names: list[str] = []
        t = set(self.target_modules)
        if "self_attention.o_proj" in t:
            names.append("o_proj")
        if "self_attention.q_a_proj" in t:
            names.append("q_a_proj")
        if "self_attention.kv_a_proj_with_mqa" in t:
            names.append("kv_a_proj_with_mqa")
        # Routed experts are served under the gate/up/down names too (SGLang's MoE LoRA naming).
        if t & {"mlp.linear_fc1", "mlp.experts.linear_fc1"}:
            names += ["gate_proj", "up_proj"]
        if t & {"mlp.linear_fc2", "mlp.experts.linear_fc2"}:
            names.append("down_proj")
        return names

    def peft_config(self) -> dict[str, Any]:
        """The config dict sent with every chunk and written as ``adapter_config.json`` (PEFT ``LoraConfig`` keys)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.hf_target_modules(),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "experts_shared_outer_loras": True,
            # Our exact targets: the HF names above cannot tell dense/shared MLPs from routed experts.
            "k3_target_modules": list(self.target_modules),
        }

    @classmethod
    def from_peft_config(cls, d: dict[str, Any], where: str = "adapter config") -> "LoRAConfig":
        """Read back ``peft_config()`` output. Without our ``k3_target_modules`` key (a config written elsewhere),
        the recipe targets implied by the HF ``target_modules`` are used: experts share names with the MLPs."""
        if d.get("peft_type") != "LORA":
            raise LoRAConfigError(f"{where}: peft_type={d.get('peft_type')!r}: expected 'LORA'")
        for key in ("r", "lora_alpha"):
            if key not in d:
                raise LoRAConfigError(f"{where}: missing {key!r}")
        if d.get("bias", "none") != "none":
            raise LoRAConfigError(f"{where}: bias={d['bias']!r}: expected 'none'")
        if d.get("use_dora") or d.get("use_rslora"):
            raise LoRAConfigError(f"{where}: use_dora/use_rslora are set: plain LoRA only")
        rank, alpha, dropout = int(d["r"]), float(d["lora_alpha"]), float(d.get("lora_dropout", 0.0))
        if d.get("k3_target_modules"):
            return cls(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(d["k3_target_modules"]))
        hf = set(d.get("target_modules") or [])
        targets = []
        if "o_proj" in hf:
            targets.append("self_attention.o_proj")
        if "q_a_proj" in hf:
            targets.append("self_attention.q_a_proj")
        if "kv_a_proj_with_mqa" in hf:
            targets.append("self_attention.kv_a_proj_with_mqa")
        if hf & {"gate_proj", "up_proj"}:
            targets += ["mlp.linear_fc1", "mlp.experts.linear_fc1"]
        if "down_proj" in hf:
            targets += ["mlp.linear_fc2", "mlp.experts.linear_fc2"]
        if not targets:
            raise LoRAConfigError(f"{where}: target_modules={sorted(hf)}: none of them is a K3 LoRA target")
        return cls(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(targets))
