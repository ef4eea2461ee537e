"""One adapter version's chunk stream, checked chunk by chunk as it goes into SGLang."""

from __future__ import annotations

import re
from typing import Any

from k3.rollout.errors import AdapterVersionError

__all__ = ["VersionStream"]

_PEFT_NAME = re.compile(r"\.lora_[AB]\.weight$")


class VersionStream:
    """Checks one version's chunk stream as it arrives: versions, first/last flags, names, config, rank."""

    def __init__(self, version: int, max_rank: int | None, served_targets: set[str] | None) -> None:
        self.version = version
        self.max_rank = max_rank
        self.served_targets = served_targets
        self.config: dict[str, Any] | None = None
        self.count = 0
        self.complete = False
        self._names: set[str] = set()

    def accept(self, chunk: Any) -> None:
        i, v = self.count, self.version
        if self.complete:
            raise AdapterVersionError(f"adapter version {v}: chunk {i} arrives after the chunk marked is_last")
        if getattr(chunk, "version", v) != v:
            raise AdapterVersionError(f"adapter version {v}: chunk {i} carries version {chunk.version}")
        if bool(chunk.is_first) != (i == 0):
            raise AdapterVersionError(f"adapter version {v}: chunk {i} has is_first={chunk.is_first}; only the "
                                      "first chunk of a version is marked first")
        names = [n for n, _ in chunk.tensors]
        if not names:
            raise AdapterVersionError(f"adapter version {v}: chunk {i} has no tensors")
        bad = [n for n in names if not _PEFT_NAME.search(n)]
        if bad:
            raise AdapterVersionError(f"adapter version {v}: chunk {i}: {bad[:3]} are not PEFT LoRA names "
                                      "(…lora_A.weight / …lora_B.weight)")
        repeated = sorted(self._names.intersection(names))
        if repeated:
            raise AdapterVersionError(f"adapter version {v}: chunk {i} repeats {repeated[:3]}")
        self._names.update(names)
        config = dict(getattr(chunk, "config", None) or {})
        if i == 0:
            self._check_config(config)
            self.config = config
        elif config and config != self.config:
            raise AdapterVersionError(f"adapter version {v}: chunk {i} carries another adapter config")
        self.complete = bool(chunk.is_last)
        self.count += 1

    def _check_config(self, config: dict[str, Any]) -> None:
        v = self.version
        if config.get("peft_type") != "LORA" or "r" not in config or "target_modules" not in config:
            raise AdapterVersionError(f"adapter version {v}: the first chunk's config needs peft_type LORA, r and "
                                      f"target_modules (got keys {sorted(config)})")
        if self.max_rank is not None and int(config["r"]) > self.max_rank:
            raise AdapterVersionError(f"adapter version {v}: rank r={config['r']} exceeds the engine's "
                                      f"max_lora_rank={self.max_rank} (server arg)")
        if self.served_targets is not None:
            extra = sorted(set(config["target_modules"]) - self.served_targets)
            if extra:
                raise AdapterVersionError(f"adapter version {v}: targets {extra} are not in the engine's "
                                          f"lora_target_modules {sorted(self.served_targets)}")

    def finish(self) -> None:
        if self.count == 0:
            raise AdapterVersionError(f"adapter version {self.version}: no chunks")
        if not self.complete:
            raise AdapterVersionError(f"adapter version {self.version}: the stream ended after {self.count} chunks "
                                      "without the chunk marked is_last")
