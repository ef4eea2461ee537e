"""Stand-ins for the ``sglang.srt.managers.io_struct`` requests k3 builds: SGLang's fields (``BaseReq``'s
``rid``/``http_worker_ipc`` included), keyword-only, as msgspec structs are. ``__struct_fields__`` is what k3 reads
to detect streamed LoRA loading: upstream 0.5.23 has no chunk flags; set :data:`RECIPE_BUILD` fields on the class
(``use_recipe_build(True)``) to act as the recipe's SGLang build, which takes ``is_first_chunk``/``is_last_chunk``."""

from dataclasses import dataclass, fields
from typing import Any, Literal

STREAMED_FIELDS = ("is_first_chunk", "is_last_chunk")


@dataclass(kw_only=True)
class _Req:
    rid: str | None = None
    http_worker_ipc: str | None = None


@dataclass(kw_only=True)
class PauseGenerationReqInput(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"

    def __post_init__(self):
        if self.mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"PauseGenerationReqInput.mode={self.mode!r}")


@dataclass(kw_only=True)
class ContinueGenerationReqInput(_Req):
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput(_Req):
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class LoadLoRAAdapterFromTensorsReqInput(_Req):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[bytes]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None
    # Only in the recipe's SGLang build (see use_recipe_build); refused otherwise, like an unknown msgspec field.
    is_first_chunk: bool | None = None
    is_last_chunk: bool | None = None

    def __post_init__(self):
        given = [f for f in STREAMED_FIELDS if getattr(self, f) is not None]
        missing = [f for f in given if f not in type(self).__struct_fields__]
        if missing:
            raise TypeError(f"Unexpected keyword arguments {missing} (this SGLang has no streamed LoRA loading)")


UPSTREAM_FIELDS = tuple(f.name for f in fields(LoadLoRAAdapterFromTensorsReqInput) if f.name not in STREAMED_FIELDS)
LoadLoRAAdapterFromTensorsReqInput.__struct_fields__ = UPSTREAM_FIELDS


def use_recipe_build(streamed: bool) -> None:
    """Make the load request the recipe build's (with chunk flags) or upstream 0.5.23's."""
    LoadLoRAAdapterFromTensorsReqInput.__struct_fields__ = UPSTREAM_FIELDS + (STREAMED_FIELDS if streamed else ())


@dataclass(kw_only=True)
class LoRAUpdateOutput(_Req):
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


@dataclass(kw_only=True)
class FlushCacheReqOutput(_Req):
    success: bool
    message: str = ""
