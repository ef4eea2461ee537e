"""Export adapters as HF/PEFT-named chunks for the rollout engines, apply received chunks, PEFT files.

Chunking follows the recipe (§4.4): one chunk per adapter module group — the attention of layer i, the
dense MLP, the routed experts of layer i, the shared experts of layer i — in layer order. Names are
``language_model.model.layers.{i}.<hf module>.lora_{A,B}.weight``; every tensor is a fresh, contiguous
BF16 copy (never a view of a live parameter, so a receiver can hold it while training goes on). Shapes:

| chunk | tensors (in order) | shapes |
|---|---|---|
| attention | ``self_attn.o_proj`` (+ MLA: ``q_a_proj``, ``kv_a_proj_with_mqa``) A, B | o: (r, heads·head_dim), (hidden, r); q_a: (r, hidden), (q_lora_rank, r); kv_a: (r, hidden), (kv_lora_rank + rope, r) |
| dense MLP | ``mlp.{gate_proj,up_proj,down_proj}`` A, B | gate/up: (r, hidden), (intermediate, r), gate A = up A; down: (r, intermediate), (hidden, r) |
| shared experts | ``block_sparse_moe.shared_experts.{gate_proj,up_proj,down_proj}`` | as dense with F = shared width |
| routed experts | ``block_sparse_moe.experts.{w1,w3,w2}`` A, B | w1/w3 A (1, r, latent), B (E, F, r); w2 A (E, r, F), B (1, latent, r) |

The names, groups and shapes come from the target table (``k3/settings/lora.py``: each row's blocks, modules
and ``peft_shapes``); the table above is what the recipe's seven targets give. The leading 1 on the shared
expert factors is SGLang's shared-outer serving contract. Before the first chunk is produced the export checks
that the model holds exactly the adapters its config and ``LoRAConfig`` call for (each once, with the right
shape), and raises ``ExportError`` otherwise, so a stream is never partial.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from k3.checkpoint.hf_io import TEXT_PREFIX
from k3.config import K3Config
from k3.lora.apply import apply_lora, lora_modules
from k3.lora.experts import LoRALatentExperts
from k3.lora.linear import LoRALinear
from k3.settings.lora import EXPORT_GROUPS, LoRAConfig, LoRAConfigError, lora_targets
from k3.transport.handoff import flat_views

# ``out(numel, dtype, device)`` -> the 1-D tensor a chunk is written into (``export_chunks``' ``out``).
ChunkAllocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]

__all__ = [
    "AdapterChunk", "ChunkAllocator", "ChunkSpec", "ExportError", "chunk_layout", "export_chunks", "load_chunk",
    "load_adapter_tensors", "save_peft_adapter", "load_peft_adapter", "read_peft_adapter_config", "write_peft_adapter", "PEFT_PREFIX",
    "ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "adapter_nbytes",
]

PEFT_PREFIX = "base_model.model."  # PEFT's key prefix in adapter_model.safetensors
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


class ExportError(RuntimeError):
    """The model's adapters are not exactly the expected set, or a tensor has the wrong shape or name."""


@dataclass
class AdapterChunk:
    """One module group's adapter tensors, ready to send.

    ``tensors``: ordered ``(peft_name, tensor)``; ``version``: the adapter version it belongs to;
    ``is_first``/``is_last``: its place in the version's stream; ``config``: the PEFT config dict;
    ``group``/``layer``: which module group it is.
    """

    tensors: list[tuple[str, torch.Tensor]]
    version: int
    is_first: bool
    is_last: bool
    config: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    layer: int = -1

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass(frozen=True)
class ChunkSpec:
    """Names and shapes of one chunk, from the config alone."""

    group: str
    layer: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...]


def _ab(prefix: str, a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{prefix}.lora_A.weight", a), (f"{prefix}.lora_B.weight", b)]


def chunk_layout(cfg: K3Config, lora: LoRAConfig) -> list[ChunkSpec]:
    """The chunks a model of ``cfg`` with ``lora`` exports, in stream order (names and shapes, no data).

    Per layer, one chunk per export group that holds adapters, groups in ``EXPORT_GROUPS`` order; inside a chunk
    the targets in table order, each module's A then B."""
    specs: list[ChunkSpec] = []
    for i in range(cfg.num_hidden_layers):
        by_group: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for target in lora.targets:
            for block in target.placement.blocks_at(cfg, i):
                a, b = target.peft_shapes(cfg, i, lora.rank)
                for module in target.peft_modules(block):
                    by_group.setdefault(block.group, []).extend(
                        _ab(f"{TEXT_PREFIX}model.layers.{i}.{module}", a, b))
        specs += [ChunkSpec(group, i, tuple(by_group[group])) for group in EXPORT_GROUPS if group in by_group]
    return specs


# ---------------------------------------------------------------------- name <-> parameter
@dataclass(frozen=True)
class _Slot:
    param: nn.Parameter
    shared_expert_dim: bool  # exported with a leading 1


def _adapter_slots(model: nn.Module) -> dict[str, _Slot]:
    """Every adapter factor of the model by its PEFT name (without ``base_model.model.``)."""
    slots: dict[str, _Slot] = {}
    for path, m in lora_modules(model):
        base = TEXT_PREFIX + path
        if isinstance(m, LoRALinear):
            slots[f"{base}.lora_A.weight"] = _Slot(m.lora_A, False)
            slots[f"{base}.lora_B.weight"] = _Slot(m.lora_B, False)
        elif isinstance(m, LoRALatentExperts):
            shared = _shared_expert_factors()
            for factor in m.factor_names():
                w, ab = factor.split("_lora_")
                slots[f"{base}.{w}.lora_{ab}.weight"] = _Slot(getattr(m, factor), factor in shared)
    return slots


def _shared_expert_factors() -> set[str]:
    """Routed-expert factors shared by all experts (``w1_lora_A``, ...): exported with a leading expert dim of 1."""
    return {f"{module}_lora_{t.shared_expert_factor}" for t in lora_targets() if t.shared_expert_factor
            for module in t.modules}


def _exported_shape(slot: _Slot) -> tuple[int, ...]:
    shape = tuple(slot.param.shape)
    return (1, *shape) if slot.shared_expert_dim else shape


def _model_configs(model: nn.Module) -> tuple[K3Config, LoRAConfig]:
    cfg, lora = getattr(model, "config", None), getattr(model, "lora_config", None)
    if not isinstance(cfg, K3Config):
        raise ExportError(f"{type(model).__name__} has no K3Config at .config: export needs the layer schedule")
    if not isinstance(lora, LoRAConfig):
        raise ExportError(f"{type(model).__name__} carries no adapters (no .lora_config): call apply_lora first")
    return cfg, lora


def _check_complete(layout: list[ChunkSpec], slots: dict[str, _Slot]) -> None:
    expected = [name for spec in layout for name, _ in spec.tensors]
    dup = sorted(n for n, k in Counter(expected).items() if k > 1)
    missing = sorted(set(expected) - set(slots))
    unexpected = sorted(set(slots) - set(expected))
    shapes = {name: shape for spec in layout for name, shape in spec.tensors}
    wrong = [f"{n} {_exported_shape(slots[n])} (expected {shapes[n]})" for n in sorted(set(expected) & set(slots))
             if _exported_shape(slots[n]) != shapes[n]]
    problems = []
    if dup:
        problems.append(f"{len(dup)} expected more than once: {dup[:3]}")
    if missing:
        problems.append(f"{len(missing)} missing: {missing[:3]}{' …' if len(missing) > 3 else ''}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {unexpected[:3]}{' …' if len(unexpected) > 3 else ''}")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape: {wrong[:3]}")
    if problems:
        raise ExportError("the model's adapters are not the expected set: " + "; ".join(problems))


def export_chunks(
    model: nn.Module,
    version: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    out: ChunkAllocator | None = None,
) -> Iterator[AdapterChunk]:
    """Yield the model's adapters as one ``AdapterChunk`` per module group, in layer order.

    Args:
        model: a K3 model with adapters (``apply_lora``).
        version: the adapter version (an integer >= 0; the recipe's first sync sends 1).
        dtype: tensor dtype of the export (BF16, the serving contract).
        device: where the exported copies live (default: each parameter's device).
        out: ``out(numel, dtype, device)`` -> a 1-D tensor each chunk is written into, its tensors consecutive
            views of it (``AdapterProducer.bucket_for``: the chunk is then already its bucket). Called once per
            chunk, when the chunk is made; default: a fresh tensor per adapter tensor.

    Completeness is checked before the first chunk (``ExportError``). Chunks are materialized one at a
    time (plus one of look-ahead to know ``is_last``), so the export never holds the whole adapter.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"export_chunks: version={version!r}: expected an integer >= 0")
    cfg, lora = _model_configs(model)
    layout = chunk_layout(cfg, lora)
    slots = _adapter_slots(model)
    _check_complete(layout, slots)
    config = lora.peft_config()
    return _stream(layout, slots, version, dtype, device, config, out)


def _stream(layout: list[ChunkSpec], slots: dict[str, _Slot], version: int, dtype: torch.dtype,
            device: torch.device | str | None, config: dict[str, Any],
            out: ChunkAllocator | None) -> Iterator[AdapterChunk]:
    last = len(layout) - 1
    for k, spec in enumerate(layout):
        tensors = []
        with torch.no_grad():
            if out is None:
                for name, _ in spec.tensors:
                    slot = slots[name]
                    t = slot.param.detach().to(device=device or slot.param.device, dtype=dtype, copy=True)
                    tensors.append((name, (t.unsqueeze(0) if slot.shared_expert_dim else t).contiguous()))
            else:
                first = slots[spec.tensors[0][0]].param
                where = torch.device(device) if device is not None else first.device
                flat = out(sum(math.prod(shape) for _, shape in spec.tensors), dtype, where)
                for (name, _), view in zip(spec.tensors, flat_views(flat, [s for _, s in spec.tensors])):
                    slot = slots[name]
                    view.copy_(slot.param.detach().unsqueeze(0) if slot.shared_expert_dim else slot.param.detach())
                    tensors.append((name, view))
                del flat
        yield AdapterChunk(tensors, version, is_first=k == 0, is_last=k == last, config=dict(config),
                           group=spec.group, layer=spec.layer)
        del tensors


# ---------------------------------------------------------------------- applying received tensors
def _strip(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> list[str]:
    """Copy PEFT-named adapter tensors into the model's adapters; returns the names loaded.

    Names may carry PEFT's ``base_model.model.`` prefix. Unknown names and wrong shapes raise ``ExportError``;
    so do different gate and up ``lora_A`` of one MLP (they are one tied Parameter here). ``strict``: every
    adapter tensor of the model must be given.
    """
    slots = _adapter_slots(model)
    given: dict[str, torch.Tensor] = {}
    for raw, t in named:
        name = _strip(raw)
        if name not in slots:
            raise ExportError(f"adapter tensor {raw} matches no adapter of this model")
        if name in given:
            raise ExportError(f"adapter tensor {raw} given twice")
        want = _exported_shape(slots[name])
        if tuple(t.shape) != want:
            raise ExportError(f"adapter tensor {raw} has shape {tuple(t.shape)}, expected {want}")
        given[name] = t
    if strict:
        missing = sorted(set(slots) - set(given))
        if missing:
            raise ExportError(f"{len(missing)} adapter tensors missing, e.g. {missing[:3]}")
    tied: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in given.items():
        pid = id(slots[name].param)
        if pid in tied and not torch.equal(tied[pid][1].to(t.dtype), t):
            raise ExportError(f"{name} differs from {tied[pid][0]}: the gate and up projections of one MLP share "
                              "one lora_A (Megatron's fused fc1)")
        tied[pid] = (name, t)
    for name, t in given.items():
        slot = slots[name]
        slot.param.copy_(t.squeeze(0) if slot.shared_expert_dim else t)
    return list(given)


def load_chunk(model: nn.Module, chunk: AdapterChunk) -> list[str]:
    """Apply one received chunk to the model's adapters by PEFT name (an engine's side of the export)."""
    return load_adapter_tensors(model, chunk.tensors)


# ---------------------------------------------------------------------- PEFT files
def save_peft_adapter(model: nn.Module, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's layout) into ``directory``.

    Keys are ``base_model.model.`` + the export names, values BF16. Files are written under temporary
    names and renamed, so an interrupted save leaves the previous adapter intact. Returns the directory.
    """
    _, lora = _model_configs(model)
    tensors: dict[str, torch.Tensor] = {}
    for chunk in export_chunks(model, version=0, device="cpu"):
        tensors.update(chunk.tensors)
    return write_peft_adapter(directory, tensors, lora, base_model_name_or_path)


def write_peft_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], lora: LoRAConfig,
                       base_model_name_or_path: str | None = None) -> Path:
    """Write export-named adapter ``tensors`` and ``lora``'s config as PEFT files into ``directory``.

    Keys get the ``base_model.model.`` prefix; each file goes under a temporary name and is renamed, so an
    interrupted save leaves the previous adapter intact. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = lora.peft_config()
    config["base_model_name_or_path"] = base_model_name_or_path
    config["inference_mode"] = True
    weights_tmp = directory / (ADAPTER_WEIGHTS_NAME + ".tmp")
    config_tmp = directory / (ADAPTER_CONFIG_NAME + ".tmp")
    save_file({PEFT_PREFIX + n: t for n, t in tensors.items()}, str(weights_tmp), metadata={"format": "pt"})
    config_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(weights_tmp, directory / ADAPTER_WEIGHTS_NAME)
    os.replace(config_tmp, directory / ADAPTER_CONFIG_NAME)
    return directory


def read_peft_adapter_config(directory: str | Path) -> tuple[LoRAConfig, Path, Path]:
    """The ``LoRAConfig`` of a PEFT adapter directory, with the paths of its config and weights files.

    Raises ``FileNotFoundError`` when either file is missing, ``LoRAConfigError`` when the config is not valid
    JSON or not a LoRA config this project can serve."""
    directory = Path(directory)
    cfg_path, weights_path = directory / ADAPTER_CONFIG_NAME, directory / ADAPTER_WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: not found (a PEFT adapter directory has {ADAPTER_CONFIG_NAME} and "
                                    f"{ADAPTER_WEIGHTS_NAME})")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LoRAConfigError(f"{cfg_path}: not valid JSON: {e}") from e
    return LoRAConfig.from_peft_config(raw, where=str(cfg_path)), cfg_path, weights_path


def load_peft_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Load a ``save_peft_adapter`` directory into ``model`` (attaching adapters first if it has none).

    The directory's rank, alpha and targets must match adapters already on the model. Every adapter tensor
    must be present with its exact shape. Returns ``model``.
    """
    lora, cfg_path, weights_path = read_peft_adapter_config(directory)
    have = getattr(model, "lora_config", None)
    if have is None:
        apply_lora(model, lora)
    elif (have.rank, have.alpha, have.target_modules) != (lora.rank, lora.alpha, lora.target_modules):
        raise LoRAConfigError(f"{cfg_path}: r={lora.rank}, alpha={lora.alpha:g}, targets {list(lora.target_modules)} "
                              f"do not match the model's adapters (r={have.rank}, alpha={have.alpha:g}, targets "
                              f"{list(have.target_modules)})")
    with safe_open(str(weights_path), framework="pt") as f:
        named = [(k, f.get_tensor(k)) for k in f.keys()]
    try:
        load_adapter_tensors(model, named, strict=True)
    except ExportError as e:
        raise ExportError(f"{weights_path}: {e}") from e
    return model


def adapter_nbytes(layout: Sequence[ChunkSpec], dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a whole exported adapter with this layout."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(s) for spec in layout for _, s in spec.tensors) * size
