"""The converter's BF16 output loads with ``from_pretrained`` and gives exactly the logits of the model built from
the MXFP4 source's decoded tensors."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoint.convert import convert_mxfp4_to_bf16
from k3.checkpoint.hf_io import load_state_dict
from k3.checkpoint.synth import write_synthetic_checkpoint
from k3.config import K3Config, variant
from k3.kernels.mxfp4.codec import decode_mxfp4

model_mod = pytest.importorskip("k3.model")


def model_from_native(native, scale_bump: str | None = None) -> torch.nn.Module:
    """The tiny model with the source's tensors, packed experts decoded here (``scale_bump``: a name prefix whose
    packed weights get every scale raised by one, i.e. doubled, to show that the logits see the experts)."""
    cfg = K3Config.from_json(native).replace(quantization_config=None)
    src = load_state_dict(native)
    state = {}
    for name, t in src.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            scale = src[base + "_scale"]
            if scale_bump and base.startswith(scale_bump):
                scale = scale + 1
            state[base] = decode_mxfp4(t, scale)
        else:
            state[name] = t
    with torch.device("meta"):
        model = model_mod.KimiK3ForCausalLM(cfg, dtype=torch.float32)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.to(dtypes[k]) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def test_converted_checkpoint_gives_the_logits_of_the_decoded_source(tmp_path):
    native = write_synthetic_checkpoint(variant("tiny"), tmp_path / "native", "mxfp4", seed=11,
                                        max_shard_size=100_000, progress=False)
    out = tmp_path / "bf16"
    convert_mxfp4_to_bf16(native, out, progress=False)
    converted = model_mod.KimiK3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = model_from_native(native)
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = converted(ids), reference(ids)
        bumped = model_from_native(native, "model.layers.1.block_sparse_moe.experts.")(ids)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, want)
    assert not torch.equal(bumped, want)  # the comparison sees the experts
