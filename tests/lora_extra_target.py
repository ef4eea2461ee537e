"""Test-only: a LoRA target that is not one of the recipe's, to show that one table row is all a target takes.

``Q_B_PROJ`` adapts MLA's ``self_attn.q_b_proj`` (``q_lora_rank -> heads · qk_head_dim``), a column-parallel
linear in the Megatron backend (the style of ``mlp.linear_fc1``, unfused). ``add_row()`` puts it into
``k3.settings.lora.LORA_TARGETS`` of this process (a megatron test worker); pytest tests use the fixture in
``tests/unit/test_lora_target_table.py``, which takes it out again. Shipped code keeps the recipe's seven rows.
"""

from __future__ import annotations

from k3.settings import lora as lora_settings
from k3.settings.lora import LoRATarget, ParallelStyle, Placement

__all__ = ["Q_B_PROJ", "add_row"]

Q_B_PROJ = LoRATarget(name="self_attention.q_b_proj", placement=Placement.MLA_LAYERS, modules=("q_b_proj",),
                      serving_names=("q_b_proj",), factors=("q_b",), style=ParallelStyle.COLUMN,
                      features=lambda c, i: (c.q_lora_rank, c.num_attention_heads * c.qk_head_dim), optional=True)


def add_row() -> None:
    """Append ``Q_B_PROJ`` to this process's target table (for a worker process that runs nothing else)."""
    if Q_B_PROJ not in lora_settings.LORA_TARGETS:
        lora_settings.LORA_TARGETS = (*lora_settings.LORA_TARGETS, Q_B_PROJ)
