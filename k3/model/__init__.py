"""The reference Kimi-K3 text model in plain PyTorch (CPU exact; CUDA uses fla for the KDA core)."""

from k3.model.cache import K3Cache, StaticK3Cache
from k3.model.model import K3DecoderLayer, KimiK3ForCausalLM, KimiK3Model

__all__ = ["KimiK3ForCausalLM", "KimiK3Model", "K3Cache", "StaticK3Cache", "K3DecoderLayer"]
