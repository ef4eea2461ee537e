"""Data settings: the training and eval files a run reads and the keys read from them (recipe §6.2).

Pure data: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataSettings"]


@dataclass(frozen=True)
class DataSettings:
    """Training and eval files under ``--data-dir`` and the keys read from them. Field names are keys of the
    resolved-config dump; the eval fields are None when the run does not evaluate."""

    prompt_data: str
    input_key: str
    label_key: str
    apply_chat_template: bool
    eval_dataset_name: str | None
    eval_prompt_data: str | None
    eval_input_key: str | None
