"""The embedded rollout engine: the DESIGN engine protocol on the reference ``k3.model`` (the default engine).

Batched generation (left-padded prompts, one decode step for the whole batch), temperature / top-p sampling, stop
on eos, per-token logprobs; adapters arrive as complete versions of HF/PEFT-named chunks; memory tags can be
released and resumed (the base weights are kept on host while released: the recipe's ``lora_base_cpu_backup``).

How a batch decodes is ``DecodeSettings`` resolved for the device (``decode_plan``): the loop (``decode_loop``)
keeps tokens, logprobs and the stop state on the device and syncs with the host once every
``stop_check_interval`` steps; the model runs through a stepper (``steppers``): the grown reference cache, the
engine's static cache (``decode_memory``, memory tag ``kv_cache``) at host positions, or at its device position
with CUDA graphs (``cuda_graph``, tag ``cuda_graph``) and flashinfer's MLA kernel (``flashinfer_attention``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from k3.kernels.small_ops_mode import triton_small_ops
from k3.kernels.small_ops_probe import probe_small_op_kernels
from k3.kernels.mla_decode.naive import mla_decode_masked
from k3.lora import apply_lora
from k3.model import KimiK3ForCausalLM
from k3.model.mla import MLADecodeAttention
from k3.rollout.embedded.adapter_loader import AdapterLoader
from k3.rollout.embedded.decode_loop import Stepper, decode_batch
from k3.rollout.embedded.decode_memory import DecodeMemory
from k3.rollout.embedded.decode_plan import DecodePlan, resolve_decode
from k3.rollout.embedded.sampling import sample_next, sample_next_flashinfer
from k3.rollout.embedded.steppers import EagerStepper, StaticStepper, WindowStepper
from k3.rollout.embedded.weight_backup import WeightBackup
from k3.rollout.errors import EngineStateError
from k3.rollout.protocol import GenerateRequest, Sample, SamplingParams, check_tags
from k3.settings.decode import DecodeSettings
from k3.settings.rollout import ROLLOUT_MAX_CONCURRENCY

log = logging.getLogger(__name__)

_SAMPLERS = {"torch": sample_next, "flashinfer": sample_next_flashinfer}


class EmbeddedEngine:
    """Rollout on an in-process ``KimiK3ForCausalLM`` with LoRA modules attached (B = 0 until a version lands).

    ``model`` is a model object (already carrying LoRA) or a BF16 HF checkpoint directory; ``tokenizer`` has
    ``encode``/``decode``/``eos_id``/``pad_id``. ``max_concurrency`` caps the batch of one generation pass
    (the recipe's ``--rollout-max-concurrency``). ``decode``: how a pass decodes (``DecodeSettings``; the default
    ``auto`` is CUDA graphs + flashinfer on CUDA, the static cache elsewhere); the resolved plan is logged and kept
    in ``decode_plan``.
    """

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        tokenizer: Any,
        lora_config: Any | None = None,
        max_concurrency: int = ROLLOUT_MAX_CONCURRENCY,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_backup: bool = True,
        decode: DecodeSettings | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: expected >= 1")
        if isinstance(model, (str, Path)):
            model = KimiK3ForCausalLM.from_pretrained(model, dtype=dtype)
        if lora_config is not None:
            model = apply_lora(model, lora_config)
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        self.device = torch.device(device)
        self.cpu_backup = cpu_backup
        self._version = 0
        self._released: set[str] = set()
        self._backup = WeightBackup(self.device)
        self._loader = AdapterLoader(self.model)
        self.decode_plan: DecodePlan = resolve_decode(decode or DecodeSettings(), self.device, self.model)
        log.info("embedded engine on %s: %s", self.device, self.decode_plan.describe())
        self._memory = DecodeMemory(self.model, self.device)
        self._graph_off: str | None = None  # why CUDA graphs stopped being used (a capture failed)
        self._flashinfer_off: str | None = None  # why flashinfer's MLA attention stopped being used
        self._small_ops_off: str | None = None  # why the fused small-op kernels were left (their probe)
        self._small_ops_probed = False

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """Generate one response per request, ``max_concurrency`` requests per batched pass, in order."""
        if self._released:
            raise EngineStateError(
                f"generate() while memory tags {sorted(self._released)} are released: call resume_memory first"
            )
        gen = None
        if sampling.seed is not None:  # on the device: the draws stay there (CPU: the same stream as ever)
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        stop_ids = torch.tensor(sorted({self.tokenizer.eos_id, *sampling.stop_token_ids}), dtype=torch.int64,
                                device=self.device)
        out: list[Sample] = []
        for i in range(0, len(requests), self.max_concurrency):
            out.extend(self._generate_batch(requests[i : i + self.max_concurrency], sampling, gen, stop_ids))
        return out

    def _generate_batch(
        self, batch: Sequence[GenerateRequest], sampling: SamplingParams, gen: torch.Generator | None,
        stop_ids: torch.Tensor,
    ) -> list[Sample]:
        B = len(batch)
        if any(len(r.prompt_ids) == 0 for r in batch):
            raise ValueError("a request has an empty prompt: every prompt needs at least one token")
        L = max(len(r.prompt_ids) for r in batch)
        pad = self.tokenizer.pad_id
        ids = torch.full((B, L), pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(batch):  # left padding: every prompt ends at column L-1
            n = len(r.prompt_ids)
            ids[b, L - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, L - n :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        plan = self.decode_plan
        # The fused small-op kernels for this batch's prefill, warm-up, graph capture and steps (replays run
        # the captured kernels).
        with triton_small_ops(self._small_op_kernels()):
            stepper = self._stepper([len(r.prompt_ids) for r in batch], L + sampling.max_new_tokens)
            res = decode_batch(stepper, ids, mask, sampling, stop_ids, gen, plan.stop_check_interval,
                               _SAMPLERS[plan.sampler])
        return [
            Sample(
                prompt_ids=list(r.prompt_ids),
                tokens=res.tokens[b],
                text=self.tokenizer.decode(res.tokens[b]),
                logprobs=res.logprobs[b],
                finish_reason=res.finish_reasons[b],
                adapter_version=self._version,
                meta=dict(r.meta),
            )
            for b, r in enumerate(batch)
        ]

    def _stepper(self, prompt_lens: list[int], length: int) -> Stepper:
        """The model runner of one batch in the plan's mode (falling back, logged, where a fast path failed)."""
        mode, B = self.decode_plan.mode, len(prompt_lens)
        if mode == "eager":
            return EagerStepper(self.model)
        if mode == "static":
            return StaticStepper(self.model, self._memory.rows(B, length))
        graph = mode == "graph" and self._graph_off is None
        rows = self.decode_plan.bucket(B) if graph else B
        view = self._memory.rows(rows, length)
        attention, kind = self._window_attention(rows if graph else 0)
        captured = None
        if graph:
            try:
                prepare = (lambda: self._plan_probe(attention, rows)) if kind == "flashinfer" else None
                captured = self._memory.graph(rows, kind, attention, prepare)
            except Exception as e:  # noqa: BLE001 - any capture failure: decode without graphs, said once
                self._graph_off = f"{type(e).__name__}: {e}"
                log.warning("embedded engine: CUDA graph capture failed for %d rows (%s); decoding without CUDA "
                            "graphs from now on", rows, self._graph_off)
                self._memory.release_graphs()
                return self._stepper(prompt_lens, length)
            view.reset()
        return WindowStepper(self.model, view, prompt_lens, self.tokenizer.pad_id, attention, captured)

    def _small_op_kernels(self) -> bool:
        """Whether this batch runs the model's small ops (RMSNorm, SiTU, the AttnRes mix, KDA's head norms) as fused
        Triton kernels: the plan's choice, probed once against the plain ops (kernels that do not build here or
        disagree are left, logged, for the plain ops)."""
        if self.decode_plan.small_ops != "triton" or self._small_ops_off is not None:
            return False
        if not self._small_ops_probed:
            self._small_ops_probed = True
            embed = self.model.model.embed_tokens.weight
            problem = probe_small_op_kernels(self.device, embed.dtype, embed.shape[1])
            if problem is not None:
                self._small_ops_off = problem
                log.warning("embedded engine: the fused small-op kernels failed their probe (%s); using the "
                            "plain ops from now on", problem)
                return False
        return True

    def _window_attention(self, graph_rows: int) -> tuple[MLADecodeAttention, str]:
        """The window's MLA attention and its kind; flashinfer's is probed once per wrapper and left, logged, for
        torch's if it fails."""
        if self.decode_plan.mla_kernel != "flashinfer" or self._flashinfer_off is not None:
            return mla_decode_masked, "torch"
        try:
            att = self._memory.flashinfer_attention(graph_rows)
            if graph_rows == 0 and not att.probed:
                self._plan_probe(att, 1)
                view = self._memory.rows(1, 1)
                self.model.decode_step(torch.zeros(1, dtype=torch.int64, device=self.device), view, att)
                view.reset()
                att.probed = True
            return att, "flashinfer"
        except Exception as e:  # noqa: BLE001 - a missing JIT toolchain, an unsupported GPU, ...: torch instead
            self._flashinfer_off = f"{type(e).__name__}: {e}"
            log.warning("embedded engine: flashinfer's MLA decode failed (%s); using the torch attention from now on",
                        self._flashinfer_off)
            return mla_decode_masked, "torch"

    @staticmethod
    def _plan_probe(attention: Any, rows: int) -> None:
        """A plan for warm-up steps from an empty cache: every row starts at column 0 and sees one token."""
        attention.begin_batch([0] * rows)
        attention.plan_step(1)

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, chunks: Iterable[Any], version: int) -> None:
        """Apply one complete adapter version; on any error the engine keeps serving the previous one."""
        self._loader.load(chunks, version, current=self._version)
        self._version = version

    def activate(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Apply a version that arrived already assembled (the hand-off receiver checked its completeness)."""
        if version <= self._version:
            raise ValueError(f"adapter version {version} is not newer than the active version {self._version}")
        self._loader.load_tensors(tensors)
        self._version = version

    def adapter_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: Sequence[str]) -> None:
        """Free the tagged regions; ``generate`` refuses to run until they are resumed. ``weights``: parameters
        (base + adapters) move to a host backup (``weight_backup``: pinned buffers, reused) and the device copies are
        dropped (the CUDA graphs, which point at them, go too); ``kv_cache``: the static decode cache and what reads it (graphs, flashinfer buffers);
        ``cuda_graph``: the captured graphs."""
        tags = check_tags(tags)
        self._memory.release(tags)
        if "weights" in tags and "weights" not in self._released:
            if not self.cpu_backup:
                raise EngineStateError(
                    "release_memory(['weights']) without a host backup would lose the base weights: "
                    "enable lora_base_cpu_backup"
                )
            self._memory.release_graphs()
            self._backup.save(self.model)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._released.update(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Bring the tagged regions back: the weights from the host backup, the static cache at its last size
        (CUDA graphs are captured again when next used)."""
        tags = check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            self._backup.restore(self.model)
        self._memory.resume(tags)
        self._released.difference_update(tags)

    def decode_cache_bytes(self) -> int:
        """Bytes the static decode cache holds on the device (0 while ``kv_cache`` is released or before use)."""
        return self._memory.nbytes()

    def released_tags(self) -> list[str]:
        return sorted(self._released)

    def shutdown(self) -> None:
        self._memory.release(("kv_cache", "cuda_graph"))
        self._backup.clear()
        self.model = None  # type: ignore[assignment]
