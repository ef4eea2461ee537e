"""What this package uses of SGLang, declared once: the pinned release, every name it calls (``SGLANG_SURFACE``,
checked against that release's source by ``tests/unit/test_sglang_contract.py``), the shapes of SGLang's results
and memory tags, and the checks that SGLang is importable here.

Cheap to import (no torch, no sglang): the registry's ``kind`` and the launcher's checks use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from k3.rollout.sglang.errors import SGLangUnavailableError

__all__ = ["CLUSTER_INSTALL_HINT", "FOLLOWER_NONBLOCKING_ENV", "RETURN_ORIGINAL_LOGPROB_ENV", "SGLANG_FINISH_TYPES",
           "SGLANG_MEMORY_TAG_CONSTANTS", "SGLANG_META_KEYS", "SGLANG_RESULT_KEYS", "SGLANG_SURFACE", "SGLANG_VERSION",
           "STREAMED_LOAD_FIELDS", "SGLangUse", "installed_sglang_version", "require_sglang",
           "supports_streamed_lora_load"]

# The one pin: pyproject's `cluster` extra must admit it (the contract test checks both agree).
SGLANG_VERSION = "0.5.23"
CLUSTER_INSTALL_HINT = "pip install 'k3-lora-rl[cluster]'"
STREAMED_LOAD_FIELDS = ("is_first_chunk", "is_last_chunk")
RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# "0": an Engine on node_rank >= 1 of a multi-node engine returns once its schedulers are up instead of blocking
# (those nodes run no tokenizer: they only hold their TP ranks; the head node's Engine drives them).
FOLLOWER_NONBLOCKING_ENV = "SGLANG_BLOCK_NONZERO_RANK_CHILDREN"

_ENGINE = "sglang/srt/entrypoints/engine.py"
_TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
_IO_STRUCT = "sglang/srt/managers/io_struct.py"
_TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
_COMMON = "sglang/srt/utils/common.py"
_PATCH_TORCH = "sglang/srt/utils/patch_torch.py"


@dataclass(frozen=True)
class SGLangUse:
    """One name of SGLang this package uses, with where the pinned release defines it.

    ``kind``: ``method`` / ``async_method`` (``target`` = ``Class.method``, called with ``positional`` positional
    arguments and ``keywords``), ``function``, ``struct`` (a msgspec / dataclass constructed with ``keywords``
    as fields), ``attribute`` (``Class.attr`` assigned in ``__init__``), ``kwargs_class`` (constructed with
    ``**server_args``, whose keys the test checks against ServerArgs). ``optional_keywords`` are used only when
    the installed SGLang declares them (detected at run time). ``module`` is the file in the sglang package.
    """

    kind: str
    module: str
    target: str
    positional: int = 0
    keywords: tuple[str, ...] = ()
    optional_keywords: tuple[str, ...] = ()


SGLANG_SURFACE: tuple[SGLangUse, ...] = (
    SGLangUse("kwargs_class", _ENGINE, "Engine"),
    SGLangUse("attribute", _ENGINE, "Engine.tokenizer_manager"),
    SGLangUse("attribute", _ENGINE, "Engine.loop"),
    SGLangUse("method", _ENGINE, "Engine.generate",
              keywords=("input_ids", "sampling_params", "return_logprob", "lora_path")),
    SGLangUse("method", _ENGINE, "Engine.unload_lora_adapter", keywords=("lora_name",)),
    SGLangUse("method", _ENGINE, "Engine.flush_cache"),
    SGLangUse("method", _ENGINE, "Engine.release_memory_occupation", keywords=("tags",)),
    SGLangUse("method", _ENGINE, "Engine.resume_memory_occupation", keywords=("tags",)),
    SGLangUse("method", _ENGINE, "Engine.shutdown"),
    # Not on Engine in 0.5.23: reached the way Engine's own methods do, through its tokenizer manager.
    SGLangUse("async_method", _TOKENIZER_MANAGER, "TokenizerManager.pause_generation", positional=1),
    SGLangUse("async_method", _TOKENIZER_MANAGER, "TokenizerManager.continue_generation", positional=1),
    SGLangUse("async_method", _TOKENIZER_MANAGER, "TokenizerManager.update_weight_version", positional=1),
    SGLangUse("async_method", _TOKENIZER_MANAGER, "TokenizerManager.load_lora_adapter_from_tensors",
              positional=2),
    SGLangUse("struct", _IO_STRUCT, "PauseGenerationReqInput", keywords=("mode",)),
    SGLangUse("struct", _IO_STRUCT, "ContinueGenerationReqInput", keywords=("torch_empty_cache",)),
    SGLangUse("struct", _IO_STRUCT, "UpdateWeightVersionReqInput", keywords=("new_version", "abort_all_requests")),
    SGLangUse("struct", _IO_STRUCT, "LoadLoRAAdapterFromTensorsReqInput",
              keywords=("lora_name", "config_dict", "serialized_named_tensors", "load_format", "pinned",
                        "expected_checksums"),
              optional_keywords=STREAMED_LOAD_FIELDS),
    SGLangUse("struct", _TENSOR_BUCKET, "FlattenedTensorMetadata",
              keywords=("name", "shape", "dtype", "start_idx", "end_idx", "numel")),
    SGLangUse("method", _COMMON, "MultiprocessingSerializer.serialize", positional=1),
    SGLangUse("function", _PATCH_TORCH, "monkey_patch_torch_reductions"),
)
# What a generate result holds (tokenizer_manager.py builds these dicts) and SGLang's finish-reason types.
SGLANG_RESULT_KEYS = ("text", "output_ids", "meta_info")
SGLANG_META_KEYS = ("finish_reason", "output_token_logprobs", "weight_version")
SGLANG_FINISH_TYPES = {"stop": "stop", "length": "length"}  # SGLang type -> protocol finish_reason
SGLANG_MEMORY_TAG_CONSTANTS = {"GPU_MEMORY_TYPE_WEIGHTS": "weights", "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
                               "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph"}


def installed_sglang_version() -> str | None:
    """The importable sglang's version (package metadata, else ``sglang.__version__`` of a source tree)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return version("sglang")
    except PackageNotFoundError:
        return getattr(importlib.import_module("sglang"), "__version__", None)


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailableError(
            f"the SGLang rollout engine needs sglang=={SGLANG_VERSION}, which is not installed: on a CUDA machine "
            f"run `{CLUSTER_INSTALL_HINT}`, or put an SGLang source tree on PYTHONPATH (--sglang-path); on CPU use "
            "--rollout-engine embedded"
        )
    try:
        importlib.import_module("sglang.srt.entrypoints.engine")
    except Exception as e:  # noqa: BLE001 - any import failure means the runtime is not usable here
        raise SGLangUnavailableError(
            f"sglang is installed but its engine cannot be imported ({type(e).__name__}: {e}): it needs a CUDA "
            f"torch and sgl-kernel (`{CLUSTER_INSTALL_HINT}` on a GPU machine)"
        ) from e
    found = installed_sglang_version()
    if found is not None and found != SGLANG_VERSION:
        warnings.warn(f"sglang {found} is installed; k3-lora-rl is written and contract-tested against "
                      f"{SGLANG_VERSION}", stacklevel=3)


def require_sglang(sglang_path: str | None = None, import_engine: bool = True) -> None:
    """Make sglang importable here or say how: ``sglang_path`` (a directory holding ``sglang/``, the recipe's
    ``--sglang-path``) goes first on ``sys.path`` when it has one. ``import_engine`` also imports SGLang's engine
    (which needs a CUDA torch and sgl-kernel); without it only the package must be found (a driver that starts
    engines elsewhere). Raises :class:`SGLangUnavailableError` with the install hint."""
    if sglang_path and (Path(sglang_path) / "sglang").is_dir() and str(sglang_path) not in sys.path:
        sys.path.insert(0, str(sglang_path))
        importlib.invalidate_caches()
    if import_engine:
        _require_sglang()
    elif importlib.util.find_spec("sglang") is None:
        _require_sglang()  # raises with the install hint


def supports_streamed_lora_load(request_fields: Iterable[str]) -> bool:
    """Whether an SGLang whose ``LoadLoRAAdapterFromTensorsReqInput`` has ``request_fields`` takes chunk streams."""
    fields = set(request_fields)
    return all(f in fields for f in STREAMED_LOAD_FIELDS)
