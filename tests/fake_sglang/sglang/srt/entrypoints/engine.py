"""Stand-in for ``sglang.srt.entrypoints.engine.Engine`` (see the package docstring).

It serves the checkpoint at ``model_path`` with ``k3.rollout.embedded.engine.EmbeddedEngine`` (the reference K3 on CPU),
adapters applied by PEFT name from the flattened buckets it is sent, so its log-probabilities are the trainer's
when the adapter arrived intact. What it enforces, as SGLang does or must:

* every call from the thread that created it (SGLang's asyncio loop belongs to that thread);
* ``generate`` neither while paused (SGLang would block) nor while a memory region is released;
* a region released twice or resumed without being released is an error (torch_memory_saver is fatal there);
* an adapter is servable only once complete: in the recipe build's streamed mode after the chunk marked last;
  a name being loaded, or not loaded, cannot be generated with;
* one serialized payload per TP rank, each deserialized on its own, all equal;
* no LoRA load with the weights released.

For each load it records which process made each TP rank's payload (``payload_pids``: the producer's pid, read from
the name of the shared-memory segment a CPU payload lies in), so a test can tell whose bucket each rank opened.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import uuid

import torch

import sglang
from sglang.srt.managers.io_struct import FlushCacheReqOutput, LoRAUpdateOutput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import reconstruct

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
SAMPLING_KEYS = {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim"}


class FakeSGLangError(RuntimeError):
    """Something the real SGLang would refuse, hang on, or get silently wrong."""


class Engine:
    def __init__(self, **kwargs):
        self.server_args = dict(kwargs)
        self.tokenizer_manager = TokenizerManager(self)
        self.loop = asyncio.new_event_loop()
        self.weight_version = str(kwargs.get("weight_version", "default"))
        self.tp_size = int(kwargs.get("tp_size", 1))
        self.released: set[str] = set()
        self.paused = False
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # complete, servable
        self.partial: dict[str, dict[str, torch.Tensor]] = {}  # streamed, waiting for the last chunk
        self.lora_config: dict | None = None
        self.closed = False
        self._owner = threading.get_ident()
        self._embedded = None
        self._with_lora = False
        self._active: str | None = None  # the adapter now copied into the model (None: base)
        self._zeros: dict[str, torch.Tensor] = {}
        sglang.ENGINES.append(self)
        self._record("Engine", tp_size=self.tp_size, enable_lora=kwargs.get("enable_lora"))

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, call: str, **details) -> None:
        if threading.get_ident() != self._owner:
            raise FakeSGLangError(f"{call} called from another thread than the one that created the Engine (its "
                                  "asyncio loop belongs to that one)")
        if self.closed and call != "shutdown":
            raise FakeSGLangError(f"{call} after shutdown")
        sglang.record("engine", call, paused=self.paused, released=sorted(self.released), **details)

    # ------------------------------------------------------------------ the public Engine API (SGLang's signatures)
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, require_reasoning=False, return_hidden_states=False,
                 return_routed_experts=False, routed_experts_start_len=0, stream=False, bootstrap_host=None,
                 bootstrap_port=None, bootstrap_room=None, routed_dp_rank=None, disagg_prefill_dp_rank=None,
                 kv_hints=None, data_parallel_rank=None, external_trace_header=None, rid=None, session_params=None,
                 priority=None, session_id=None, *, cache_salt=None):
        from k3.rollout.protocol import GenerateRequest, SamplingParams

        names = sorted({n for n in (lora_path or [None])}, key=str)
        self._record("generate", n=len(input_ids or []), lora_path=names)
        if self.paused:
            raise FakeSGLangError("generate while generation is paused: SGLang would wait for continue_generation")
        if self.released:
            raise FakeSGLangError(f"generate with {sorted(self.released)} released")
        if prompt is not None or input_ids is None or not return_logprob:
            raise FakeSGLangError("k3 generates from input_ids with return_logprob=True")
        if len(names) > 1:
            raise FakeSGLangError(f"one batch with adapters {names}: max_loras_per_batch is 1")
        if lora_path is not None and len(lora_path) != len(input_ids):
            raise FakeSGLangError("lora_path needs one entry per request")
        name = names[0]
        if name is not None and name not in self.adapters:
            state = "still loading (its last chunk has not arrived)" if name in self.partial else "not loaded"
            raise FakeSGLangError(f"adapter {name} is {state}")
        if len(sampling_params) != len(input_ids):
            raise FakeSGLangError("sampling_params needs one dict per request")
        unknown = {k for p in sampling_params for k in p} - SAMPLING_KEYS
        if unknown:
            raise FakeSGLangError(f"sampling params the fake does not know: {sorted(unknown)}")
        first = sampling_params[0]
        engine = self._engine_with(name)
        sampling = SamplingParams(temperature=first["temperature"], top_p=first["top_p"],
                                  max_new_tokens=first["max_new_tokens"], seed=first.get("sampling_seed"),
                                  stop_token_ids=tuple(first.get("stop_token_ids", ())))
        samples = engine.generate([GenerateRequest(list(ids)) for ids in input_ids], sampling)
        return [{"text": s.text, "output_ids": list(s.tokens),
                 "meta_info": {"id": uuid.uuid4().hex, "finish_reason": {"type": s.finish_reason},
                               "output_token_logprobs": [(lp, t, None) for lp, t in zip(s.logprobs, s.tokens)],
                               "weight_version": self.weight_version, "prompt_tokens": len(s.prompt_ids),
                               "completion_tokens": len(s.tokens)}}
                for s in samples]

    def unload_lora_adapter(self, lora_name: str):
        self._record("unload_lora_adapter", lora_name=lora_name)
        if self.adapters.pop(lora_name, None) is None and self.partial.pop(lora_name, None) is None:
            return LoRAUpdateOutput(success=False, error_message=f"adapter {lora_name} is not loaded")
        if self._active == lora_name:
            self._active = "<unloaded>"
        return LoRAUpdateOutput(success=True)

    def flush_cache(self):
        self._record("flush_cache")
        return FlushCacheReqOutput(success=True)

    def release_memory_occupation(self, tags=None):
        tags = list(MEMORY_TAGS if tags is None else tags)
        self._record("release_memory_occupation", tags=tags)
        twice = sorted(set(tags) & self.released)
        if twice or set(tags) - set(MEMORY_TAGS):
            raise FakeSGLangError(f"release of {tags}: {twice or tags} already released or unknown")
        if "weights" in tags and not self.server_args.get("enable_weights_cpu_backup"):
            raise FakeSGLangError("weights released without enable_weights_cpu_backup: the base would be lost")
        self.released.update(tags)

    def resume_memory_occupation(self, tags=None):
        tags = list(MEMORY_TAGS if tags is None else tags)
        self._record("resume_memory_occupation", tags=tags)
        never = sorted(set(tags) - self.released)
        if never:
            raise FakeSGLangError(f"resume of {never}, which were never released (fatal in torch_memory_saver)")
        self.released.difference_update(tags)

    def shutdown(self):
        self._record("shutdown")
        self.closed = True
        self._embedded = None

    # ------------------------------------------------------------------ what the tokenizer manager forwards
    def _pause(self, obj) -> None:
        self._record("pause_generation", mode=obj.mode)
        if self.paused:
            raise FakeSGLangError("pause_generation while paused")
        self.paused = True

    def _continue(self, obj) -> None:
        self._record("continue_generation", torch_empty_cache=obj.torch_empty_cache)
        if not self.paused:
            raise FakeSGLangError("continue_generation while not paused")
        self.paused = False

    def _update_weight_version(self, obj) -> None:
        self._record("update_weight_version", new_version=obj.new_version, abort_all_requests=obj.abort_all_requests)
        self.weight_version = obj.new_version

    def _load_lora(self, obj) -> LoRAUpdateOutput:
        streamed = obj.is_first_chunk is not None
        if len(obj.serialized_named_tensors) != self.tp_size:
            raise FakeSGLangError(f"{len(obj.serialized_named_tensors)} payloads for {self.tp_size} TP ranks")
        per_rank, pids = [], []
        for data in obj.serialized_named_tensors:  # each TP rank deserializes its own copy
            payload = MultiprocessingSerializer.deserialize(data)
            pids.append(_producer_pid(payload["flattened_tensor"]))
            per_rank.append([(n, t.clone()) for n, t in reconstruct(payload["flattened_tensor"], payload["metadata"])])
            del payload
        self._record("load_lora_adapter_from_tensors", lora_name=obj.lora_name, first=obj.is_first_chunk,
                     last=obj.is_last_chunk, payloads=len(obj.serialized_named_tensors), payload_pids=pids)
        if "weights" in self.released:
            return LoRAUpdateOutput(success=False, error_message="LoRA load with the weights released")
        if obj.load_format != "flattened_bucket":
            raise FakeSGLangError(f"load_format {obj.load_format!r}: k3 sends flattened buckets")
        for other in per_rank[1:]:
            if [n for n, _ in other] != [n for n, _ in per_rank[0]] or not all(
                    torch.equal(a, b) for (_, a), (_, b) in zip(other, per_rank[0])):
                raise FakeSGLangError("TP ranks received different tensors")
        named = dict(per_rank[0])
        if len(named) != len(per_rank[0]):
            return LoRAUpdateOutput(success=False, error_message="a tensor name repeats in one bucket")
        for name, want in (obj.expected_checksums or {}).items():
            got = hashlib.sha256(named[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            if got != want:
                return LoRAUpdateOutput(success=False, error_message=f"checksum of {name} differs")
        if self.lora_config is None:
            self.lora_config = dict(obj.config_dict)
        name = obj.lora_name
        if not streamed:
            if name in self.adapters:
                return LoRAUpdateOutput(success=False, error_message=f"adapter {name} is already loaded")
            self.adapters[name] = named
        else:
            if obj.is_first_chunk:
                if name in self.adapters or name in self.partial:
                    return LoRAUpdateOutput(success=False, error_message=f"adapter {name} is already loaded")
                self.partial[name] = {}
            elif name not in self.partial:
                return LoRAUpdateOutput(success=False, error_message=f"chunk of {name} without its first chunk")
            again = sorted(set(named) & set(self.partial[name]))
            if again:
                return LoRAUpdateOutput(success=False, error_message=f"{again[:2]} sent twice")
            self.partial[name].update(named)
            if obj.is_last_chunk:  # finalized only now: servable from here on
                self.adapters[name] = self.partial.pop(name)
        return LoRAUpdateOutput(success=True)

    # ------------------------------------------------------------------ the model behind it
    def _engine_with(self, name: str | None):
        from k3.lora import LoRAConfig, apply_lora
        from k3.lora.export import load_adapter_tensors
        from k3.model import KimiK3ForCausalLM
        from k3.rollout.embedded.engine import EmbeddedEngine
        from k3.tokenizer import load_tokenizer

        if self._embedded is not None and self.lora_config is not None and not self._with_lora:
            self._embedded, self._active = None, None  # built before the first adapter: rebuild with LoRA
        if self._embedded is None:
            path = self.server_args["model_path"]
            self._with_lora = self.lora_config is not None
            model = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.float32)
            if self.lora_config is not None:
                model = apply_lora(model, LoRAConfig.from_peft_config(self.lora_config))
            self._embedded = EmbeddedEngine(model, load_tokenizer(path),
                                            max_concurrency=int(self.server_args.get("max_running_requests", 64)))
        if name != self._active:
            if name is None:
                tensors = self._zeros
            else:
                tensors = self.adapters[name]
                self._zeros = self._zeros or {n: torch.zeros_like(t) for n, t in tensors.items()}
            if tensors:
                load_adapter_tensors(self._embedded.model, tensors.items())
            self._active = name
        return self._embedded


def _producer_pid(t: torch.Tensor) -> int | None:
    """The pid of the process that made the shared-memory segment ``t`` lies in (torch names them
    ``/torch_<pid>_…`` under the ``file_system`` strategy), or None (CUDA, or not a named segment)."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or not storage.is_shared():
        return None
    try:
        name = storage._share_filename_cpu_()[1]
    except RuntimeError:
        return None
    match = re.match(rb"/torch_(\d+)_", name if isinstance(name, bytes) else name.encode())
    return int(match.group(1)) if match else None
