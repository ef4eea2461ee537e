"""The SGLang rollout engine: the DESIGN engine protocol on ``sglang.Engine`` (the ``cluster`` extra).

SGLang cannot be installed on the development machines (it pins a CUDA torch), so this module is written
against the source of the pinned release (:data:`SGLANG_VERSION`) and checked against it without running it:
``tests/unit/test_sglang_contract.py`` downloads that release and verifies, with ``ast``, every name in
:data:`SGLANG_SURFACE` (methods, keywords, request fields, attributes) and every server argument that
:func:`build_server_args` emits. The same test reads :class:`_SGLangBackend` — the only code here that
touches sglang — and fails if it uses anything the surface list does not declare, so the two cannot drift.

How the protocol maps onto SGLang (``miles-k3-recipe.md`` §4.5, §5):

| protocol | SGLang |
|---|---|
| ``generate`` | ``Engine.generate(input_ids=…, sampling_params=[…], return_logprob=True, lora_path=[name, …])`` |
| ``load_adapter`` | ``pause_generation(retract)``, ``flush_cache``, ``unload_lora_adapter`` (the previous version), |
| | ``load_lora_adapter_from_tensors`` (flattened buckets), ``update_weight_version``, ``continue_generation`` |
| ``release_memory(tags)`` | ``flush_cache`` then ``release_memory_occupation(tags)`` |
| ``resume_memory(tags)`` | ``resume_memory_occupation(tags)`` |

Adapter transport. Each chunk is flattened into one SGLang ``FlattenedTensorBucket`` (one flat ``uint8``
tensor plus per-tensor byte ranges, :func:`build_lora_payload`), serialized once per engine TP rank with
SGLang's ``MultiprocessingSerializer`` (a CUDA IPC handle for a GPU bucket, shared memory for a CPU one) and
sent with ``load_format="flattened_bucket"``. Two load modes, picked from the installed SGLang:

* ``streamed`` — one ``load_lora_adapter_from_tensors`` per chunk with ``is_first_chunk``/``is_last_chunk``
  (the recipe's SGLang build accumulates the chunks and finalizes the adapter after the last one). Used when
  SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` declares those two fields.
* ``whole`` — upstream SGLang (0.5.23 has no chunk fields): the chunks of a version are validated as they
  arrive and sent as one bucket in one call. Memory: the version's adapter is held twice while it is
  flattened (fine for the 4layer variant; the full model's adapter, ~49 GB at rank 32, needs ``streamed``).

Versions: the engine serves one adapter (``max_loras_per_batch=1``) named :data:`LORA_NAME`. As in the recipe,
the previous version is unloaded before the first chunk of a new one goes out, so a failure part-way leaves
the engine on the base model (``adapter_version() == 0``) and the error says so; ``atomic_swap=True`` loads
each version under its own name and unloads the old one only after the new one is complete (twice the host
memory of an adapter; then a failure changes nothing). Stream errors found before anything is sent (a bad
version, flags out of place, a rank above ``max_lora_rank``; in ``whole`` mode every stream error) change
nothing in either mode.

Chunk by chunk. ``load_adapter`` takes a whole stream; the trainer's hand-off delivers one chunk at a time, so
:meth:`SGLangEngine.begin_adapter` returns an :class:`AdapterLoad` that takes each chunk as it arrives (``add``)
and activates the version in ``finish`` — the same calls in the same order (``k3.rl.sglang_worker`` forwards the
hand-off's chunks this way).

Generation pause. ``load_adapter`` pauses generation itself (mode ``retract``) and continues afterwards — unless
the caller paused first, in which case the engine stays paused: the recipe continues generation only after
every trainer rank finished its sync cleanup (§5.4 step 7), so the trainer calls :meth:`SGLangEngine.
pause_generation` / :meth:`~SGLangEngine.continue_generation` around the whole sync.

Log-probabilities: the protocol wants them under the unscaled model distribution, so the engine starts SGLang
with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (otherwise SGLang returns them after temperature / top-p).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3.rollout.adapter_loader import AdapterVersionError
from k3.rollout.embedded import EngineStateError
from k3.rollout.protocol import MEMORY_TAGS, GenerateRequest, Sample, SamplingParams, check_tags

__all__ = [
    "SGLANG_VERSION",
    "CLUSTER_INSTALL_HINT",
    "LORA_NAME",
    "SGLANG_SURFACE",
    "SGLangUse",
    "SGLangEngine",
    "AdapterLoad",
    "SGLangError",
    "SGLangUnavailableError",
    "BucketEntry",
    "build_server_args",
    "build_sampling_params",
    "build_lora_payload",
    "unflatten_lora_payload",
    "sglang_bucket_payload",
    "sample_from_output",
    "supports_streamed_lora_load",
    "installed_sglang_version",
    "require_sglang",
    "FOLLOWER_NONBLOCKING_ENV",
]

log = logging.getLogger(__name__)

# The one pin: pyproject's `cluster` extra must admit it (the contract test checks both agree).
SGLANG_VERSION = "0.5.23"
CLUSTER_INSTALL_HINT = "pip install 'k3-lora-rl[cluster]'"
LORA_NAME = "k3_lora"
PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_MODES = ("auto", "streamed", "whole")
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


# ---------------------------------------------------------------------------------------------- SGLang surface
@dataclass(frozen=True)
class SGLangUse:
    """One name of SGLang this module uses, with where the pinned release defines it.

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


class SGLangUnavailableError(ImportError):
    """sglang (or its GPU runtime) is not importable here."""


class SGLangError(RuntimeError):
    """SGLang refused a call or returned something this module cannot read; the message says what state remains."""


def installed_sglang_version() -> str | None:
    """The importable sglang's version (package metadata, else ``sglang.__version__`` of a source tree)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        from importlib.metadata import PackageNotFoundError, version

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
    import sys
    from pathlib import Path

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


# ---------------------------------------------------------------------------------------------- server args
def _flat_config(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict") and callable(config.to_dict):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"build_server_args: expected a ResolvedConfig or a mapping, got {type(config).__name__}")


def _need(flat: Mapping[str, Any], key: str) -> Any:
    if flat.get(key) is None:
        raise ValueError(f"build_server_args: {key!r} is missing (a resolved_config.json key, e.g. from "
                         "`k3 train --dry-run`)")
    return flat[key]


def build_server_args(config: Any, **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for one rollout engine of a run (recipe §4.5, §5.1–5.2, §6.1).

    ``config`` is a ``ResolvedConfig`` or its flat form (``resolved_config.json``; plain keyword dicts with
    the same keys work too: ``hf_checkpoint``, ``model_variant``, ``rollout_num_gpus_per_engine``,
    ``lora_rank``, ``target_modules`` are required, the rest default like ``k3 train``). ``overrides`` are
    applied last (a ``None`` value removes a key); an engine spanning several nodes needs ``dist_init_addr``
    and ``node_rank`` there. Raises ``ValueError`` naming the key at fault.
    """
    from k3.settings.lora import LoRAConfig, LoRAConfigError

    flat = _flat_config(config)
    variant = _need(flat, "model_variant")
    tp = int(flat.get("rollout_num_gpus_per_engine") or flat.get("rollout_tp_size") or 0)
    if tp < 1:
        raise ValueError("build_server_args: 'rollout_num_gpus_per_engine' (the engine's TP size) must be >= 1")
    ep = int(flat.get("sglang_ep_size") or 1)
    if ep < 1 or tp % ep:
        raise ValueError(f"build_server_args: sglang_ep_size {ep} must divide the engine's TP size {tp}")
    rank = int(flat.get("sglang_max_lora_rank") or _need(flat, "lora_rank"))
    try:
        targets = LoRAConfig(rank=rank, target_modules=tuple(_need(flat, "target_modules"))).hf_target_modules()
    except LoRAConfigError as e:
        raise ValueError(f"build_server_args: target_modules: {e}") from None
    if flat.get("experts_shared_outer_loras", True) is not True:
        raise ValueError("build_server_args: experts_shared_outer_loras must be True (K3's expert adapters share "
                         "their outer factors; SGLang serves them only in that layout)")
    memory_saver = bool(flat.get("offload_rollout", True))
    cpu_backup = bool(flat.get("lora_base_cpu_backup", True))
    if cpu_backup and not memory_saver:
        raise ValueError("build_server_args: lora_base_cpu_backup needs offload_rollout (SGLang builds the host "
                         "mirror of its base only when it releases its weights)")
    concurrency = flat.get("sglang_max_running_requests") or flat.get("rollout_max_concurrency") or 64

    args: dict[str, Any] = {
        "model_path": str(_need(flat, "hf_checkpoint")),
        "trust_remote_code": True,
        "tp_size": tp,
        "ep_size": ep,
        "weight_version": "0",  # numeric from the start, so every sample's version parses
        # LoRA (§4.5): one adapter served at a time, HF target names, wrong names fail instead of being dropped.
        "enable_lora": True,
        "max_loras_per_batch": 1,
        "max_lora_rank": rank,
        "lora_target_modules": targets,
        "lora_backend": "triton",
        "lora_strict_loading": True,
        "experts_shared_outer_loras": True,
        # Above TP8 the per-rank MoE width gets tile-padded and the virtual-experts kernel rejects it.
        "lora_use_virtual_experts": tp <= 8,
        # Memory (§5.1, §5.2): release/resume need the memory saver; the CPU backup keeps the base on host.
        "enable_memory_saver": memory_saver,
        "enable_weights_cpu_backup": cpu_backup,
        "max_running_requests": int(concurrency),
    }
    optional = {
        "random_seed": flat.get("seed"),
        "max_total_tokens": flat.get("sglang_max_total_tokens"),
        "max_mamba_cache_size": flat.get("sglang_max_mamba_cache_size"),
        "cuda_graph_bs_decode": list(flat["sglang_cuda_graph_bs"]) if flat.get("sglang_cuda_graph_bs") else None,
        "context_length": flat.get("sglang_context_length"),
        "mem_fraction_static": flat.get("sglang_mem_fraction_static"),
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if variant == "full":
        args.update(moe_runner_backend="marlin", decode_attention_backend="trtllm_mla",
                    mamba_radix_cache_strategy="extra_buffer", cuda_graph_backend_prefill="disabled")
    else:
        args.update(moe_runner_backend="triton", disable_shared_experts_fusion=True)

    gpus_per_node = int(flat.get("num_gpus_per_node") or 8)
    if tp > gpus_per_node:
        if tp % gpus_per_node:
            raise ValueError(f"build_server_args: an engine of TP {tp} cannot span whole nodes of "
                             f"{gpus_per_node} GPUs")
        args["nnodes"] = tp // gpus_per_node
        missing = [k for k in ("dist_init_addr", "node_rank") if overrides.get(k) is None]
        if missing:
            raise ValueError(f"build_server_args: an engine of TP {tp} spans {args['nnodes']} nodes of "
                             f"{gpus_per_node} GPUs: pass {' and '.join(missing)} (dist_init_addr='HOST:PORT' of "
                             f"the engine's first node, node_rank 0..{args['nnodes'] - 1})")
    for key, value in overrides.items():
        if value is None:
            args.pop(key, None)
        else:
            args[key] = value
    return args


# ---------------------------------------------------------------------------------------------- sampling
def build_sampling_params(sampling: SamplingParams, num_requests: int,
                          stop_token_ids: Iterable[int] = ()) -> list[dict[str, Any]]:
    """One SGLang ``sampling_params`` dict per request.

    Text is decoded like the embedded engine's (special tokens kept, the stop token not trimmed). A ``seed``
    gives request ``i`` the seed ``seed + i`` — identical prompts of a GRPO group must not share one — and
    SGLang honours it only when the server runs with ``enable_deterministic_inference``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests}: expected >= 0")
    stops = sorted({*sampling.stop_token_ids, *stop_token_ids})
    base: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "max_new_tokens": int(sampling.max_new_tokens),
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    if stops:
        base["stop_token_ids"] = stops
    out = []
    for i in range(num_requests):
        params = dict(base)
        if sampling.seed is not None:
            params["sampling_seed"] = int(sampling.seed) + i
        out.append(params)
    return out


# ---------------------------------------------------------------------------------------------- results
def sample_from_output(output: Mapping[str, Any], request: GenerateRequest, adapter_version: int,
                       decode: Callable[[list[int]], str] | None = None) -> Sample:
    """Map one SGLang generate result onto a :class:`Sample`.

    ``output`` is SGLang's dict: ``output_ids`` (response tokens), ``text``, ``meta_info`` with
    ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``), ``output_token_logprobs``
    (``[(logprob, token_id, text | None), ...]``, one per response token) and ``weight_version`` (the adapter
    version that finished the request, a string). ``adapter_version`` is used when the engine's
    ``weight_version`` is not a number; ``decode`` supplies the text when SGLang returns none
    (``skip_tokenizer_init``). Raises :class:`SGLangError` on an aborted, unfinished or inconsistent result.
    """
    meta = output.get("meta_info") if isinstance(output, Mapping) else None
    rid = meta.get("id", "?") if isinstance(meta, Mapping) else "?"
    if not isinstance(meta, Mapping) or "output_ids" not in output:
        keys = sorted(output) if isinstance(output, Mapping) else type(output).__name__
        raise SGLangError(f"SGLang result {rid}: expected keys output_ids and meta_info, got {keys}")
    tokens = [int(t) for t in output["output_ids"]]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind == "abort":
        message = finish.get("message", "") if isinstance(finish, Mapping) else ""
        raise SGLangError(f"SGLang aborted request {rid}: {message or 'no reason given'}")
    if kind not in SGLANG_FINISH_TYPES:
        raise SGLangError(f"SGLang result {rid}: finish_reason {finish!r} is not stop or length (unfinished?)")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangError(f"SGLang result {rid}: no output_token_logprobs (the request must set return_logprob)")
    logprobs = [float(e[0]) for e in entries]
    logprob_ids = [int(e[1]) for e in entries]
    if logprob_ids != tokens:
        raise SGLangError(f"SGLang result {rid}: {len(entries)} logprobs for {len(tokens)} tokens, or their token "
                          "ids differ from output_ids")
    text = output.get("text")
    if text is None:
        text = decode(tokens) if decode is not None else ""
    weight_version = str(meta.get("weight_version", ""))
    version = int(weight_version) if weight_version.isdigit() else adapter_version
    return Sample(prompt_ids=list(request.prompt_ids), tokens=tokens, text=text, logprobs=logprobs,
                  finish_reason=SGLANG_FINISH_TYPES[kind], adapter_version=version, meta=dict(request.meta))


# ---------------------------------------------------------------------------------------------- adapter payload
@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a flattened bucket: bytes ``[start, end)`` of the flat ``uint8`` tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _named_tensors(chunk: Any) -> list[tuple[str, torch.Tensor]]:
    named = chunk.tensors if hasattr(chunk, "tensors") else chunk
    return list(named)


def build_lora_payload(chunk: Any) -> tuple[torch.Tensor, list[BucketEntry]]:
    """Flatten an ``AdapterChunk`` (or a list of ``(name, tensor)``) into SGLang's flattened-bucket layout.

    Returns ``(flat, entries)``: ``flat`` is 1-D ``uint8`` on the tensors' device, [total bytes], each tensor's
    bytes back to back in chunk order (a tensor starts on a multiple of its element size, so only a dtype
    change can leave padding); ``entries[i]`` says where tensor ``i`` lies. Inverse:
    :func:`unflatten_lora_payload`.
    """
    named = _named_tensors(chunk)
    if not named:
        raise ValueError("build_lora_payload: the chunk has no tensors")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"build_lora_payload: tensor names repeat in one chunk: {dup}")
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"build_lora_payload: the chunk's tensors lie on several devices {sorted(map(str, devices))}")
    parts: list[torch.Tensor] = []
    entries: list[BucketEntry] = []
    offset = 0
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"build_lora_payload: {name} is a {type(t).__name__}, expected a torch.Tensor")
        if not t.is_floating_point():
            raise ValueError(f"build_lora_payload: {name} has dtype {t.dtype}; adapter factors are floating point")
        pad = -offset % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append(BucketEntry(name, tuple(t.shape), t.dtype, offset, offset + raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts), entries


def unflatten_lora_payload(flat: torch.Tensor, entries: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the named tensors ``entries`` describe (what SGLang's bucket reconstructs)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"unflatten_lora_payload: expected a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    end = 0
    for e in entries:
        size = e.dtype.itemsize
        for dim in e.shape:
            size *= dim
        if e.start < end or e.end > flat.numel() or e.nbytes != size or e.start % e.dtype.itemsize:
            raise ValueError(f"unflatten_lora_payload: {e.name}: bytes [{e.start}, {e.end}) do not fit a "
                             f"{flat.numel()}-byte bucket after byte {end} as {e.dtype} {e.shape}")
        out.append((e.name, flat[e.start:e.end].view(e.dtype).reshape(e.shape)))
        end = e.end
    return out


def sglang_bucket_payload(flat: torch.Tensor, entries: Sequence[BucketEntry], metadata_cls: type) -> dict[str, Any]:
    """The object SGLang's worker deserializes for ``load_format="flattened_bucket"``: the flat tensor and one
    ``metadata_cls`` (SGLang's ``FlattenedTensorMetadata``) per tensor, byte offsets as SGLang counts them."""
    return {
        "flattened_tensor": flat,
        "metadata": [metadata_cls(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start,
                                  end_idx=e.end, numel=e.nbytes) for e in entries],
    }


def _tensor_checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes, as SGLang's worker computes them to verify a received adapter."""
    return {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest() for name, t in named}


# ---------------------------------------------------------------------------------------------- the backend
def _check_reply(reply: Any, what: str) -> None:
    if reply is None:
        return
    success = reply.get("success", True) if isinstance(reply, Mapping) else getattr(reply, "success", True)
    if success is False:
        message = (reply.get("error_message") or reply.get("message") if isinstance(reply, Mapping)
                   else getattr(reply, "error_message", None) or getattr(reply, "message", None))
        raise SGLangError(f"SGLang {what} failed: {message or 'no message'}")


class _SGLangBackend:
    """Every call into sglang, one method each (the contract test reads this class against SGLANG_SURFACE)."""

    def __init__(self, server_args: Mapping[str, Any]) -> None:
        _require_sglang()
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        # The scheduler processes inherit the environment: unscaled log-probabilities, as the protocol says.
        os.environ[RETURN_ORIGINAL_LOGPROB_ENV] = "1"
        self._engine = Engine(**server_args)
        self._tm = self._engine.tokenizer_manager
        self._run = self._engine.loop.run_until_complete
        self.tp_size = int(server_args.get("tp_size", 1))
        self.supports_streamed_load = supports_streamed_lora_load(LoadLoRAAdapterFromTensorsReqInput.__struct_fields__)

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                 lora_path: list[str] | None) -> list[dict[str, Any]]:
        out = self._engine.generate(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                                    lora_path=lora_path)
        return list(out) if isinstance(out, list) else [out]

    def load_lora_bucket(self, lora_name: str, config: dict[str, Any], flat: torch.Tensor,
                         entries: Sequence[BucketEntry], stream_flags: tuple[bool, bool] | None,
                         checksums: dict[str, str] | None) -> None:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()  # CUDA IPC handles keyed by device UUID, as SGLang's receiver expects
        payload = sglang_bucket_payload(flat, entries, FlattenedTensorMetadata)
        # One serialization per TP rank: each rank drops its own IPC reference after loading.
        per_rank = [MultiprocessingSerializer.serialize(payload) for _ in range(self.tp_size)]
        if stream_flags is None:
            request = LoadLoRAAdapterFromTensorsReqInput(
                lora_name=lora_name, config_dict=config, serialized_named_tensors=per_rank,
                load_format="flattened_bucket", pinned=False, expected_checksums=checksums)
        else:
            request = LoadLoRAAdapterFromTensorsReqInput(
                lora_name=lora_name, config_dict=config, serialized_named_tensors=per_rank,
                load_format="flattened_bucket", pinned=False, expected_checksums=checksums,
                is_first_chunk=stream_flags[0], is_last_chunk=stream_flags[1])
        _check_reply(self._run(self._tm.load_lora_adapter_from_tensors(request, None)),
                     f"load_lora_adapter_from_tensors({lora_name})")

    def unload_lora(self, lora_name: str) -> None:
        _check_reply(self._engine.unload_lora_adapter(lora_name=lora_name), f"unload_lora_adapter({lora_name})")

    def update_weight_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        # Retracted requests resume after continue_generation instead of being aborted.
        self._run(self._tm.update_weight_version(UpdateWeightVersionReqInput(new_version=version,
                                                                             abort_all_requests=False)))

    def pause_generation(self, mode: str) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._run(self._tm.pause_generation(PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._run(self._tm.continue_generation(ContinueGenerationReqInput(torch_empty_cache=True)))

    def flush_cache(self) -> None:
        _check_reply(self._engine.flush_cache(), "flush_cache")

    def release_memory(self, tags: list[str]) -> None:
        self._engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags: list[str]) -> None:
        self._engine.resume_memory_occupation(tags=tags)

    def ipc_collect(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def shutdown(self) -> None:
        self._engine.shutdown()


# ---------------------------------------------------------------------------------------------- the engine
_PEFT_NAME = re.compile(r"\.lora_[AB]\.weight$")


class _VersionStream:
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


class SGLangEngine:
    """The rollout-engine protocol on ``sglang.Engine``, plus the sync controls the trainer needs.

    ``server_args``: ``sglang.Engine`` keywords (:func:`build_server_args`; :meth:`from_resolved` builds them
    from a run's config). ``tokenizer``: optional, with ``eos_id`` (added to the stop tokens, like the embedded
    engine) and ``decode`` (used only if SGLang returns no text). ``load_mode``: ``auto`` (``streamed`` when the
    installed SGLang takes chunk streams, else ``whole``), ``streamed`` or ``whole``. ``atomic_swap``: keep the
    previous version until the new one is complete. ``pause_mode``: SGLang's pause mode around an adapter
    load. ``verify_checksums``: SGLang checks every received tensor's SHA-256 (``--check-weight-update-equal``).
    ``backend`` replaces the SGLang binding (tests).
    """

    def __init__(
        self,
        server_args: Mapping[str, Any],
        *,
        tokenizer: Any | None = None,
        lora_name: str = LORA_NAME,
        load_mode: str = "auto",
        atomic_swap: bool = False,
        pause_mode: str = "retract",
        verify_checksums: bool = False,
        backend: Any | None = None,
    ) -> None:
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode={load_mode!r}: expected one of {LOAD_MODES}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: expected one of {PAUSE_MODES}")
        if not server_args.get("enable_lora"):
            raise ValueError("server_args: enable_lora is not set, so the engine could never take an adapter "
                             "(build them with build_server_args)")
        self.server_args = dict(server_args)
        self._backend = backend if backend is not None else _SGLangBackend(self.server_args)
        streamed = bool(getattr(self._backend, "supports_streamed_load", False))
        if load_mode == "streamed" and not streamed:
            raise SGLangError(f"load_mode='streamed' needs an SGLang whose LoadLoRAAdapterFromTensorsReqInput has "
                              f"{' and '.join(STREAMED_LOAD_FIELDS)} (the recipe's build); this one has not: use "
                              "load_mode='whole' (or 'auto')")
        self.load_mode = ("streamed" if streamed else "whole") if load_mode == "auto" else load_mode
        self.tokenizer = tokenizer
        self.lora_name = lora_name
        self.atomic_swap = atomic_swap
        self.pause_mode = pause_mode
        self.verify_checksums = verify_checksums
        self._stop_ids = (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ()
        self._max_rank = server_args.get("max_lora_rank")
        targets = server_args.get("lora_target_modules")
        self._served_targets = set(targets) if targets and targets != "all" else None
        self._version = 0
        self._loaded: str | None = None  # the SGLang adapter name now serving, if any
        self._released: set[str] = set()
        self._paused = False
        self._closed = False
        self._open_load: AdapterLoad | None = None

    @classmethod
    def from_resolved(cls, resolved: Any, server_overrides: Mapping[str, Any] | None = None,
                      **engine_kwargs: Any) -> "SGLangEngine":
        """An engine for one rollout engine of a resolved ``k3 train`` run (``ResolvedConfig``)."""
        args = build_server_args(resolved, **dict(server_overrides or {}))
        flat = _flat_config(resolved)
        engine_kwargs.setdefault("verify_checksums", bool(flat.get("check_weight_update_equal", False)))
        return cls(args, **engine_kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """One response per request, in order, with the adapter now loaded (none before the first version)."""
        self._check_open()
        if self._released:
            raise EngineStateError(f"generate() while memory tags {sorted(self._released)} are released: call "
                                   "resume_memory first")
        if self._paused:
            raise EngineStateError("generate() while generation is paused: call continue_generation() first")
        if not requests:
            return []
        if any(len(r.prompt_ids) == 0 for r in requests):
            raise ValueError("a request has an empty prompt: every prompt needs at least one token")
        params = build_sampling_params(sampling, len(requests), self._stop_ids)
        lora = [self._loaded] * len(requests) if self._loaded is not None else None
        outputs = self._backend.generate([list(r.prompt_ids) for r in requests], params, lora)
        if len(outputs) != len(requests):
            raise SGLangError(f"SGLang returned {len(outputs)} results for {len(requests)} requests")
        decode = getattr(self.tokenizer, "decode", None)
        return [sample_from_output(o, r, self._version, decode) for o, r in zip(outputs, requests)]

    # ------------------------------------------------------------------ adapters
    def adapter_version(self) -> int:
        return self._version

    def load_adapter(self, chunks: Iterable[Any], version: int) -> None:
        """Load adapter ``version`` from its ``AdapterChunk`` stream (``is_first`` … ``is_last``).

        Pauses generation and flushes the cache first (continuing afterwards only if it paused it), unloads the
        previous version (see the module docstring for ``atomic_swap``), sends the buckets and sets SGLang's
        weight version to ``str(version)``. No request may still be running on the previous adapter: SGLang's
        unload waits for those to finish (``generate`` here returns only when its requests are done). Raises
        ``AdapterVersionError`` for a malformed stream and :class:`SGLangError` when SGLang refuses a call.
        The same as :meth:`begin_adapter`, :meth:`AdapterLoad.add` per chunk, :meth:`AdapterLoad.finish`.
        """
        load = self.begin_adapter(version)
        try:
            for chunk in chunks:
                load.add(chunk)
            load.finish()
        except Exception as e:
            if load.is_open:  # the chunk iterator itself failed
                raise load.abort(e) from e
            raise
        finally:
            if load.is_open:  # interrupted (KeyboardInterrupt): never leave the engine paused on a partial version
                load.abort(EngineStateError(f"loading adapter version {version} was interrupted"))

    def begin_adapter(self, version: int) -> AdapterLoad:
        """Start loading adapter ``version`` chunk by chunk, as the chunks arrive (the trainer's hand-off forwards
        each one on receipt). Pauses generation (unless the caller did) and flushes the cache now; returns the
        :class:`AdapterLoad` to ``add`` the chunks to and ``finish``. One load at a time."""
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise AdapterVersionError(f"adapter version {version!r}: expected an integer >= 1")
        if self._open_load is not None:
            raise EngineStateError(f"adapter version {version}: version {self._open_load.version} is still being "
                                   "loaded (finish or abort it first)")
        if version <= self._version:
            raise AdapterVersionError(f"adapter version {version} is not newer than the active version "
                                      f"{self._version}")
        if "weights" in self._released:
            raise EngineStateError("load_adapter() while the engine's weights are released: resume_memory(['weights'])"
                                   " first (the recipe onloads the engine's weights before update_weights)")
        return AdapterLoad(self, version)

    def _name_for(self, version: int) -> str:
        return f"{self.lora_name}_v{version}" if self.atomic_swap else self.lora_name

    def _unload_current(self) -> None:
        name, self._loaded = self._loaded, None
        if name is not None:
            # From here on the engine serves the base model; a failure later leaves it so.
            self._version = 0
            self._backend.unload_lora(name)

    def _activate(self, name: str, version: int, old: str | None) -> None:
        self._loaded, self._version = name, version
        if self.atomic_swap and old is not None and old != name:
            self._backend.unload_lora(old)
        log.info("adapter version %d loaded into SGLang as %s (%s mode)", version, name, self.load_mode)

    def _failed(self, error: Exception, version: int, name: str, sent: bool) -> Exception:
        """Clean up a broken load and say which adapter the engine serves now."""
        if sent:
            try:  # a half-received adapter must not linger under the name
                self._backend.unload_lora(name)
            except Exception as cleanup:  # noqa: BLE001 - the original error is the one to report
                log.warning("unloading the partial adapter %s failed: %s", name, cleanup)
        if self._loaded is None and self._version == 0:
            try:  # SGLang still reports the unloaded version; samples must not claim it
                self._backend.update_weight_version("0")
            except Exception as cleanup:  # noqa: BLE001
                log.warning("resetting SGLang's weight version failed: %s", cleanup)
        now = (f"the engine still serves version {self._version}" if self._loaded is not None
               else "the engine now serves the base model without an adapter (adapter_version() == 0); send a "
                    "complete version again")
        if isinstance(error, EngineStateError):
            kind: type[Exception] = EngineStateError
        elif isinstance(error, (ValueError, TypeError)):  # the stream itself was bad
            kind = AdapterVersionError
        else:
            kind = SGLangError
        return kind(f"loading adapter version {version} failed: {error}; {now}")

    # ------------------------------------------------------------------ sync controls
    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause_generation(self, mode: str | None = None) -> None:
        """Stop scheduling generation (``retract``: running requests go back to the queue). Idempotent."""
        self._check_open()
        mode = mode or self.pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {PAUSE_MODES}")
        if not self._paused:
            self._backend.pause_generation(mode)
            self._paused = True

    def continue_generation(self) -> None:
        """Resume generation after :meth:`pause_generation`. Idempotent."""
        self._check_open()
        if self._paused:
            self._backend.continue_generation()
            self._paused = False

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache."""
        self._check_open()
        self._backend.flush_cache()

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: Sequence[str]) -> None:
        """Release the tagged GPU regions (``weights``, ``kv_cache``, ``cuda_graph``); already released ones are
        skipped. The cache is flushed first, as SGLang requires. Releasing ``weights`` needs the host backup
        (``enable_weights_cpu_backup``), without which the base would be lost."""
        self._check_open()
        todo = [t for t in MEMORY_TAGS if t in check_tags(tags) and t not in self._released]
        if not todo:
            return
        if not self.server_args.get("enable_memory_saver"):
            raise EngineStateError("release_memory needs the server arg enable_memory_saver (offload_rollout)")
        if "weights" in todo and not self.server_args.get("enable_weights_cpu_backup"):
            raise EngineStateError("release_memory(['weights']) without a host backup would lose the base weights: "
                                   "enable lora_base_cpu_backup (server arg enable_weights_cpu_backup)")
        self._backend.flush_cache()
        self._backend.release_memory(todo)
        self._released.update(todo)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Resume the tagged regions that are released (resuming one that never was is skipped: SGLang's memory
        saver treats that as fatal)."""
        self._check_open()
        todo = [t for t in MEMORY_TAGS if t in check_tags(tags) and t in self._released]
        if todo:
            self._backend.resume_memory(todo)
            self._released.difference_update(todo)

    def released_tags(self) -> list[str]:
        return sorted(self._released)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("the SGLang engine was shut down")


class AdapterLoad:
    """One adapter version going into SGLang chunk by chunk (:meth:`SGLangEngine.begin_adapter`).

    ``add(chunk)`` for every chunk in stream order, then ``finish()``. In ``streamed`` mode each chunk goes out at
    once as one flattened bucket with its first/last flags (the first also unloads the previous version, unless
    ``atomic_swap``); in ``whole`` mode the chunks are checked as they arrive and sent as one bucket by
    ``finish``, which also sets SGLang's weight version. A version becomes active only in ``finish``, after its
    last chunk: an error anywhere (or :meth:`abort`) unloads what SGLang received of it, resumes generation if
    this load paused it, and the error raised says which adapter the engine serves now. A load that failed or
    finished is closed; using it again raises ``EngineStateError``.
    """

    def __init__(self, engine: SGLangEngine, version: int) -> None:
        self._engine = engine
        self.version = version
        self._stream = _VersionStream(version, engine._max_rank, engine._served_targets)
        self._name = engine._name_for(version)
        self._old = engine._loaded
        self._named: list[tuple[str, torch.Tensor]] = []  # whole mode: the version's tensors until finish()
        self._sent = False  # from the first send on, SGLang may hold part of this version
        self._paused_here = not engine.is_paused
        self.is_open = True
        engine._open_load = self
        engine.pause_generation()
        try:
            engine._backend.flush_cache()
        except Exception as e:
            raise self.abort(e) from e

    @property
    def chunks(self) -> int:
        """How many chunks were accepted so far."""
        return self._stream.count

    def add(self, chunk: Any) -> None:
        """Check ``chunk`` against the stream and (``streamed``) send it to SGLang now."""
        self._check_open()
        engine = self._engine
        try:
            self._stream.accept(chunk)
            if engine.load_mode == "whole":
                self._named.extend(chunk.tensors)
                return
            if self._stream.count == 1 and not engine.atomic_swap:
                engine._unload_current()
            flat, entries = build_lora_payload(chunk)
            checksums = _tensor_checksums(chunk.tensors) if engine.verify_checksums else None
            self._sent = True
            engine._backend.load_lora_bucket(self._name, self._stream.config, flat, entries,
                                             (bool(chunk.is_first), bool(chunk.is_last)), checksums)
            del flat
        except Exception as e:
            raise self.abort(e) from e

    def finish(self) -> None:
        """The stream ended: check it was complete, send it (``whole``), set the weight version, activate."""
        self._check_open()
        engine = self._engine
        try:
            self._stream.finish()
            if engine.load_mode == "whole":
                flat, entries = build_lora_payload(self._named)
                checksums = _tensor_checksums(self._named) if engine.verify_checksums else None
                self._named = []
                if not engine.atomic_swap:
                    engine._unload_current()
                self._sent = True
                engine._backend.load_lora_bucket(self._name, self._stream.config, flat, entries, None, checksums)
                del flat
            engine._backend.update_weight_version(str(self.version))
        except Exception as e:
            raise self.abort(e) from e
        try:
            engine._activate(self._name, self.version, self._old)
        finally:
            self._close()

    def abort(self, error: Exception) -> Exception:
        """Give the version up: unload what SGLang holds of it, close the load; returns the error to raise (its
        message says which adapter the engine serves now). On a closed load it returns ``error`` as it is."""
        if not self.is_open:
            return error
        self._named = []
        try:
            return self._engine._failed(error, self.version, self._name, sent=self._sent)
        finally:
            self._close()

    def _close(self) -> None:
        self.is_open = False
        self._engine._open_load = None
        try:
            self._engine._backend.ipc_collect()
        finally:
            if self._paused_here:
                self._engine.continue_generation()

    def _check_open(self) -> None:
        if not self.is_open:
            raise EngineStateError(f"adapter version {self.version}: this load is closed (finished or failed); "
                                   "begin a new one")
