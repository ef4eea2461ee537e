"""Run settings at the bottom of the house: frozen, typed, pure data (standard library and ``k3.config`` only).

Each part takes only its own settings object; this package imports nothing else of ``k3``, so every part may
import it. ``k3.settings.lora`` holds ``LoRAConfig`` and the LoRA target table.
"""
