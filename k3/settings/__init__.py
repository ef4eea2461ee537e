"""Run settings at the bottom of the house: frozen, typed, pure data built once by the launcher.

Each part takes only its own settings object. This package imports nothing of ``k3`` but ``k3.config``, so every
part may import it. ``k3.settings.lora`` holds ``LoRAConfig`` and the LoRA target table; ``k3.settings.worker``
what the trainer and the engine build their model from.
"""
