"""Every call into sglang, one method each: the only code of this package that touches SGLang
(``tests/unit/test_sglang_contract.py`` reads :class:`SGLangBackend` against ``surface.SGLANG_SURFACE``).

Every ``sglang`` import is inside a method: SGLang is the ``cluster`` extra, importable only on a CUDA machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from k3.rollout.sglang.errors import SGLangError
from k3.rollout.sglang.payload import BucketEntry, sglang_bucket_payload
from k3.rollout.sglang.surface import RETURN_ORIGINAL_LOGPROB_ENV, require_sglang, supports_streamed_lora_load

__all__ = ["SGLangBackend"]


def _check_reply(reply: Any, what: str) -> None:
    if reply is None:
        return
    success = reply.get("success", True) if isinstance(reply, Mapping) else getattr(reply, "success", True)
    if success is False:
        message = (reply.get("error_message") or reply.get("message") if isinstance(reply, Mapping)
                   else getattr(reply, "error_message", None) or getattr(reply, "message", None))
        raise SGLangError(f"SGLang {what} failed: {message or 'no message'}")


class SGLangBackend:
    """Every call into sglang, one method each (the contract test reads this class against SGLANG_SURFACE)."""

    def __init__(self, server_args: Mapping[str, Any]) -> None:
        require_sglang()
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

    @staticmethod
    def serialize_bucket(flat: torch.Tensor, entries: Sequence[BucketEntry]) -> bytes:
        """One engine rank's payload: the flattened bucket (``flat``: 1-D ``uint8``, ``entries`` its tensors) as
        SGLang's worker deserializes it, serialized by SGLang (a CUDA IPC handle keyed by the device's UUID, or a
        shared-memory name). Needs no engine: the trainer ranks that feed an engine rank by rank call it too."""
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()  # CUDA IPC handles keyed by device UUID, as SGLang's receiver expects
        return MultiprocessingSerializer.serialize(sglang_bucket_payload(flat, entries, FlattenedTensorMetadata))

    def load_lora_bucket(self, lora_name: str, config: dict[str, Any], flat: torch.Tensor,
                         entries: Sequence[BucketEntry], stream_flags: tuple[bool, bool] | None,
                         checksums: dict[str, str] | None) -> None:
        """Load one bucket held here, serialized once per TP rank (each rank drops its own IPC reference after
        loading): every rank opens a handle made on this process's device, so the engine must be on this node."""
        per_rank = [self.serialize_bucket(flat, entries) for _ in range(self.tp_size)]
        self.load_lora_payloads(lora_name, config, per_rank, stream_flags, checksums)

    def load_lora_payloads(self, lora_name: str, config: dict[str, Any], per_rank: list[bytes],
                           stream_flags: tuple[bool, bool] | None, checksums: dict[str, str] | None) -> None:
        """Load one chunk (or a whole adapter) from ``per_rank[i]``, TP rank ``i``'s serialized bucket, as it is."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

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
