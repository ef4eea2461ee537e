"""The embedded rollout engine: the DESIGN engine protocol on the reference ``k3.model`` (the default engine).

Batched generation with the model's caches (left-padded prompts, one decode step for the whole batch),
temperature / top-p sampling, stop on eos, per-token logprobs; adapters arrive as complete versions of
HF/PEFT-named chunks; memory tags can be released and resumed (the base weights are kept on host while
released: the recipe's ``lora_base_cpu_backup``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from k3.lora import apply_lora
from k3.model import KimiK3ForCausalLM
from k3.rollout.embedded.adapter_loader import AdapterLoader
from k3.rollout.embedded.sampling import sample_next
from k3.rollout.errors import EngineStateError
from k3.rollout.protocol import GenerateRequest, Sample, SamplingParams, check_tags
from k3.settings.rollout import ROLLOUT_MAX_CONCURRENCY


class EmbeddedEngine:
    """Rollout on an in-process ``KimiK3ForCausalLM`` with LoRA modules attached (B = 0 until a version lands).

    ``model`` is a model object (already carrying LoRA) or a BF16 HF checkpoint directory; ``tokenizer`` has
    ``encode``/``decode``/``eos_id``/``pad_id``. ``max_concurrency`` caps the batch of one generation pass
    (the recipe's ``--rollout-max-concurrency``).
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
        self._backup: dict[str, torch.Tensor] = {}
        self._loader = AdapterLoader(self.model)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """Generate one response per request, ``max_concurrency`` requests per batched pass, in order."""
        if self._released:
            raise EngineStateError(
                f"generate() while memory tags {sorted(self._released)} are released: call resume_memory first"
            )
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        out: list[Sample] = []
        for i in range(0, len(requests), self.max_concurrency):
            out.extend(self._generate_batch(requests[i : i + self.max_concurrency], sampling, gen))
        return out

    def _generate_batch(
        self, batch: Sequence[GenerateRequest], sampling: SamplingParams, gen: torch.Generator | None
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
        stops = {self.tokenizer.eos_id, *sampling.stop_token_ids}

        cache = self.model.init_cache(B)
        logits = self.model(ids, cache=cache, attention_mask=mask)[:, -1]
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        done = [False] * B
        finish = ["length"] * B
        for step in range(sampling.max_new_tokens):
            tok, lp = sample_next(logits.cpu(), sampling.temperature, sampling.top_p, gen)
            for b in range(B):
                if done[b]:
                    continue
                t = int(tok[b])
                tokens[b].append(t)
                logps[b].append(float(lp[b]))
                if t in stops:
                    done[b], finish[b] = True, "stop"
            if all(done) or step == sampling.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=1)
            logits = self.model(tok[:, None].to(self.device), cache=cache, attention_mask=mask)[:, -1]
        return [
            Sample(
                prompt_ids=list(r.prompt_ids),
                tokens=tokens[b],
                text=self.tokenizer.decode(tokens[b]),
                logprobs=logps[b],
                finish_reason=finish[b],
                adapter_version=self._version,
                meta=dict(r.meta),
            )
            for b, r in enumerate(batch)
        ]

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
        """Free the tagged regions. ``weights``: parameters (base + adapters) move to a host backup and the
        device copies are dropped; ``kv_cache`` / ``cuda_graph``: caches are per call here, so only the state is
        recorded (generate refuses to run until resumed)."""
        tags = check_tags(tags)
        if "weights" in tags and "weights" not in self._released:
            if not self.cpu_backup:
                raise EngineStateError(
                    "release_memory(['weights']) without a host backup would lose the base weights: "
                    "enable lora_base_cpu_backup"
                )
            for name, p in self.model.named_parameters():
                host = p.data if p.device.type == "cpu" else p.data.to("cpu", copy=True)
                self._backup[name] = host
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._released.update(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        tags = check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            for name, p in self.model.named_parameters():
                p.data = self._backup.pop(name).to(self.device)
        self._released.difference_update(tags)

    def released_tags(self) -> list[str]:
        return sorted(self._released)

    def shutdown(self) -> None:
        self._backup.clear()
        self.model = None  # type: ignore[assignment]
