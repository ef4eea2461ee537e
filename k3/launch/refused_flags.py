"""Flags of the public recipe's launcher that ``k3 train`` cannot honour, each with the one-line reason it gives.

They used to be accepted and printed in ``resolved_config.txt`` although nothing applied them; a printed setting
must be a setting in effect, so the parser now refuses each of them (on the command line and as its ``K3_*``
environment variable) with its reason, and they are no longer :class:`~k3.launch.args.TrainArgs` fields.
"""

from __future__ import annotations

__all__ = ["REFUSED_FLAGS", "refusal"]

# field name (the flag is --field-name, the variable K3_FIELD_NAME) -> why k3 cannot honour it, and what to do.
REFUSED_FLAGS: dict[str, str] = {
    "megatron_path": "k3 builds its model with the installed megatron-core package, not from a Megatron-LM source "
                     "tree; drop the flag",
    "megatron_model_type": "the model's shape comes from --hf-checkpoint's config.json, there is no model-type "
                           "table to pick from; drop the flag",
    "extra_args": "k3 has no Megatron-LM argument parser to pass them to; every trainer setting is a k3 train flag "
                  "(k3 train --help)",
    "save_dir": "k3 writes no Megatron checkpoint: the adapter checkpoints go to <run-dir>/adapters; set --run-dir",
    "save_debug_rollout_data": "k3 does not write the rollouts' samples; metrics.jsonl holds every rollout's "
                               "statistics; drop the flag",
    "update_weight_buffer_size": "k3 never sends base weights to the engines, only the LoRA adapters (one chunk "
                                 "per layer group; --lora-transfer-buffer chooses how they travel); drop the flag",
}


def refusal(name: str) -> str:
    """``--flag: not supported: <reason>`` for a refused field name."""
    return f"--{name.replace('_', '-')} is not supported: {REFUSED_FLAGS[name]}"
