"""What ``k3 train`` (and its ``--dry-run``) checks about the two checkpoints before anything starts.

- ``--hf-checkpoint``: a directory with a ``config.json`` K3 can run, an index (or ``model.safetensors``) whose
  shards exist, and every tensor its config implies, in its shape (shard headers only, no tensor data); its
  quantization: the native MXFP4 release (``quantization_config`` + packed routed experts, validated as
  ``k3 convert mxfp4-to-bf16`` validates it) or BF16, the config's declaration and the stored tensors agreeing.
- the backend can take it: ``--backend megatron`` loads its frozen base in BF16, so a native ``--hf-checkpoint``
  needs ``--ref-load`` (its torch_dist conversion, as the recipe pairs them); ``--backend torch`` decodes the native
  experts on load (``KimiK3ForCausalLM.from_pretrained``, bit-identical to the converted checkpoint), as do both
  engines (the embedded one through the same loader, SGLang natively).
- ``--ref-load`` (megatron): a torch_dist checkpoint (tracker, ``.metadata``, megatron's ``metadata.json``, the
  stored ``k3_config.json``) whose model is ``--hf-checkpoint``'s: the stored config field by field, as the trainer
  compares them, and every tensor's global shape from ``.metadata`` against the shapes the HF config implies
  (``k3.checkpoint.dist_metadata``). A mismatch names the field or tensor, both values and both paths.

A path that does not exist is ``k3.launch.train.check_inputs``' to report; everything here is about what an
existing path holds. All problems are returned together, one line each. The checkpoint readers load torch, so
they are imported when a check runs: importing the launcher stays torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3.checkpoint.hf_io import CheckpointError
from k3.config import K3Config, variant
from k3.launch.args import ResolvedConfig

if TYPE_CHECKING:
    from k3.checkpoint.dist_metadata import DistMetadata
    from k3.checkpoint.hf_inventory import HFInventory

__all__ = ["CheckpointFindings", "check_checkpoints", "config_differences", "SHOWN_DIFFERENCES"]

# How many differences one message lists before it says how many there are in all.
SHOWN_DIFFERENCES = 6
# The config fields that decide a model's shape (and its parallel layout): compared with --model-variant's.
_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts", "vocab_size")
_CONVERT = ("k3 convert mxfp4-to-bf16 --model-dir NATIVE --save-dir BF16, then torchrun … -m k3 convert hf-to-dist "
            "--hf-checkpoint BF16 --save DCP")


@dataclass
class CheckpointFindings:
    """``problems`` stop the run (one line each); ``notes`` are printed and do not; ``facts`` say what each
    checkpoint is and who loads it (the dry run prints them)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)


def check_checkpoints(resolved: ResolvedConfig) -> CheckpointFindings:
    """Check ``--hf-checkpoint`` and, on the megatron backend, ``--ref-load``; see the module docstring."""
    a = resolved.args
    out = CheckpointFindings()
    hf = _check_hf(a.hf_checkpoint, out) if a.hf_checkpoint is not None else None
    if hf is not None:
        _check_variant(hf, a.model_variant, out)
    megatron = a.backend == "megatron"
    if hf is not None and hf.declared_mxfp4 and hf.packed:
        if megatron and a.ref_load is None:
            out.problems.append(
                f"--hf-checkpoint {hf.directory} is the native MXFP4 checkpoint and --backend megatron trains a BF16 "
                f"base: pass its torch_dist conversion as --ref-load ({_CONVERT}), as the recipe does, or give the "
                "BF16 conversion as --hf-checkpoint")
        elif not megatron:
            out.facts.append("checkpoint: the torch trainer decodes the routed experts to BF16 on load "
                             "(KimiK3ForCausalLM.from_pretrained; bit-identical to the converted checkpoint)")
    if megatron and a.ref_load is not None and Path(a.ref_load).exists():
        _check_ref_load(a.ref_load, hf, a.hf_checkpoint, out)
    return out


def _check_hf(path: str, out: CheckpointFindings) -> HFInventory | None:
    from k3.checkpoint.convert import plan_conversion
    from k3.checkpoint.hf_inventory import layout_mismatches, read_hf_inventory

    config = Path(path) / "config.json"
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # missing or not a JSON object: check_inputs / preflight.input_problems say so
    try:
        hf = read_hf_inventory(path)
    except CheckpointError as e:
        out.problems.append(f"--hf-checkpoint: {e}: pass the directory of a K3 HF checkpoint (config.json, "
                            "model.safetensors.index.json and its shards)")
        return None
    packed = hf.packed
    if hf.declared_mxfp4 and not packed:
        experts = sorted(n for n in hf.shapes if ".experts." in n)
        example = f" (e.g. {experts[0]})" if experts else ""
        out.problems.append(
            f"--hf-checkpoint {path}: config.json declares the native MXFP4 checkpoint (quantization_config, format "
            f"{hf.quantization_format!r}), but no weight is stored packed: the routed experts are BF16{example}. A "
            "BF16 checkpoint with the release's config.json? Give it the config.json `k3 convert mxfp4-to-bf16` "
            "writes (no quantization_config), or point --hf-checkpoint at the native checkpoint")
        return None
    if packed and not hf.declared_mxfp4:
        out.problems.append(
            f"--hf-checkpoint {path}: {len(packed)} weights are stored packed MXFP4 (e.g. {packed[0]}), but "
            "config.json has no quantization_config: the release's config.json belongs beside these shards")
        return None
    if packed:
        try:
            plan_conversion(hf.directory)  # the native checkpoint as the converter and the native loader see it
        except CheckpointError as e:
            out.problems.append(f"--hf-checkpoint: the native MXFP4 checkpoint is not whole: {e}")
            return None
    wrong = layout_mismatches(hf)
    if wrong:
        out.problems.append(f"--hf-checkpoint {path}: the shards do not hold the model config.json describes: "
                            f"{_listed(wrong)}")
        return None
    if packed:
        out.facts.append(f"checkpoint: --hf-checkpoint {path} is native MXFP4 (compressed-tensors "
                         f"{hf.quantization_format}, {len(packed)} packed routed-expert weights): SGLang serves it as released, "
                         "the embedded engine decodes the experts on load")
    else:
        out.facts.append(f"checkpoint: --hf-checkpoint {path} is BF16 ({len(hf.shapes)} tensors)")
    return hf


def _check_variant(hf: HFInventory, model_variant: str, out: CheckpointFindings) -> None:
    expected = variant(model_variant)
    differ = [f"{name} {getattr(hf.config, name)} (--model-variant {model_variant}: {getattr(expected, name)})"
              for name in _SHAPE_FIELDS if getattr(hf.config, name) != getattr(expected, name)]
    if differ:
        # A note, not a problem: a smaller checkpoint stands in for the variant in tests of the launch.
        out.notes.append(f"--hf-checkpoint {hf.directory} is not the {model_variant} model: {', '.join(differ)}. The "
                         "parallel layout was derived for the variant; the trainer and the engines build the "
                         "checkpoint's model")


def _check_ref_load(ref_load: str, hf: HFInventory | None, hf_path: str | None, out: CheckpointFindings) -> None:
    from k3.checkpoint.dist_metadata import read_dist_metadata

    try:
        meta = read_dist_metadata(ref_load)
    except CheckpointError as e:
        out.problems.append(f"--ref-load {ref_load}: {e}: pass the torch_dist checkpoint `k3 convert hf-to-dist` "
                            "writes (its --save directory)")
        return
    if meta.config is None:
        out.problems.append(f"--ref-load {ref_load}: {meta.config_path} is missing, so the trainer cannot tell which "
                            f"model it holds: convert the checkpoint again with k3 convert hf-to-dist")
        return
    if hf is None:
        return  # the HF side has its own problem (or is missing): nothing to compare against
    config_path = hf.directory / "config.json"
    differences = [f"{name}: {_short(b)} in --ref-load {meta.config_path}, {_short(a)} in --hf-checkpoint {config_path}"
                   for name, a, b in config_differences(hf.config, meta.config)]
    differences += _tensor_differences(hf.config, meta, hf_path)
    if differences:
        out.problems.append(f"--ref-load {ref_load} holds another model than --hf-checkpoint {hf_path}: "
                            f"{_listed(differences)}: give the torch_dist conversion of --hf-checkpoint ({_CONVERT})")
        return
    out.facts.append(f"checkpoint: --ref-load {ref_load} is a torch_dist checkpoint ({meta.directory}, "
                     f"{len(meta.shapes)} tensors) of the same model; the megatron trainer loads its frozen base "
                     "from it")


def config_differences(a: K3Config, b: K3Config) -> list[tuple[str, Any, Any]]:
    """``(dotted field, a's value, b's value)`` for every field of the two configs' HF form that differs, the
    quantization left out (a native config and its BF16 conversion describe one model): the comparison the megatron
    trainer makes between ``--hf-checkpoint`` and ``--ref-load``."""
    left = _flat(a.replace(quantization_config=None).to_hf_dict())
    right = _flat(b.replace(quantization_config=None).to_hf_dict())
    return [(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k)]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _tensor_differences(cfg: K3Config, meta: DistMetadata, hf_path: str | None) -> list[str]:
    from k3.checkpoint.dist_metadata import dist_tensor_shapes

    expected = dist_tensor_shapes(cfg)
    out = []
    for name in expected.keys() | meta.shapes.keys():
        want, got = expected.get(name), meta.shapes.get(name)
        if want == got:
            continue
        if got is None:
            out.append(f"tensor {name} missing from --ref-load (--hf-checkpoint {hf_path} implies {list(want)})")
        elif want is None:
            out.append(f"tensor {name} {list(got)} in --ref-load is not in --hf-checkpoint {hf_path}'s model")
        else:
            out.append(f"tensor {name}: {list(got)} in --ref-load {meta.directory}, {list(want)} by --hf-checkpoint "
                       f"{hf_path}")
    return sorted(out, key=_natural)


def _natural(text: str) -> list:
    """Sort key that puts layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _listed(items: list[str]) -> str:
    shown = "; ".join(items[:SHOWN_DIFFERENCES])
    return shown if len(items) <= SHOWN_DIFFERENCES else f"{shown}; … ({len(items)} differences in all)"
