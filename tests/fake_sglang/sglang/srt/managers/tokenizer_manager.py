"""Stand-in for ``sglang.srt.managers.tokenizer_manager.TokenizerManager``: the four async control methods k3
reaches through ``Engine.tokenizer_manager`` (SGLang's signatures), each forwarded to the fake engine."""


class TokenizerManager:
    def __init__(self, engine):
        self._engine = engine

    async def pause_generation(self, obj):
        self._engine._pause(obj)

    async def continue_generation(self, obj):
        self._engine._continue(obj)

    async def update_weight_version(self, obj):
        self._engine._update_weight_version(obj)

    async def load_lora_adapter_from_tensors(self, obj, _=None):
        return self._engine._load_lora(obj)
