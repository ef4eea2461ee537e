"""The recipe's checkpoint pairing on the Megatron trainer (CPU, gloo, one process): ``--hf-checkpoint`` the native
MXFP4 release (the engine's and the tokenizer's), ``--ref-load`` its torch_dist conversion (the trainer's base).

The worker (this file as a script) makes a tiny native MXFP4 checkpoint, converts it to BF16 and then to
torch_dist, and builds the Megatron policy twice over the same torch_dist base: once with the native checkpoint as
``model_dir``, once with its BF16 conversion. Both must give the same log-probs; the engine side
(``KimiK3ForCausalLM.from_pretrained`` of the native checkpoint, decoded on load) must match too. Without
``--ref-load`` the native checkpoint is refused with a message naming both ways out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from layout_parity import trajectories

RANK, ALPHA, MAX_TOKENS = 4, 8.0, 24


def _worker(root: Path) -> dict:
    import megatron_compat

    megatron_compat.install()
    from megatron.core import parallel_state

    from k3.checkpoint.convert import convert_mxfp4_to_bf16
    from k3.checkpoint.synth import write_synthetic_checkpoint
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import load_chunk
    from k3.megatron.convert import convert_hf_to_dist
    from k3.model import KimiK3ForCausalLM
    from k3.rl.trainers.megatron import build_megatron_policy
    from k3.rl.trainers.torch import PolicyTrainer

    native = write_synthetic_checkpoint(variant("tiny"), root / "native", "mxfp4", seed=11, progress=False)
    bf16 = root / "bf16"
    convert_mxfp4_to_bf16(native, bf16, workers=1, progress=False)
    dcp = root / "dcp"
    convert_hf_to_dist(bf16, dcp, dtype=torch.float32, progress=False)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    out: dict = {}
    policies = {}
    for name, model_dir in (("native", native), ("bf16", bf16)):
        policy = build_megatron_policy(model_dir, lora, pad_id=0, max_tokens_per_micro_batch=MAX_TOKENS, seed=3,
                                       ref_load=dcp)
        policies[name] = policy
        trajs = trajectories(policy.cfg.vocab_size)
        out[f"lp_{name}"] = policy.log_probs(trajs)
        out[f"chunks_{name}"] = [[(n, t.clone()) for n, t in c.tensors] for c in policy.export_chunks(0,
                                                                                                      dtype=torch.float32)]
        if name == "native":
            # the engine side: the native checkpoint decoded on load, with the same adapters
            ref = apply_lora(KimiK3ForCausalLM.from_pretrained(native, dtype=torch.float32), lora)
            for chunk in policy.export_chunks(0, dtype=torch.float32):
                load_chunk(ref, chunk)
            out["lp_engine"] = PolicyTrainer(ref, pad_id=0, max_tokens_per_micro_batch=MAX_TOKENS).log_probs(trajs)
        policy.close()
        parallel_state.destroy_model_parallel()
    try:
        build_megatron_policy(native, lora, pad_id=0, seed=3)
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        out["no_ref_load"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    from megatron_compat import save_result

    save_result(_worker(Path(sys.argv[1])), sys.argv[1])


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_compat import worker_result

    tmp = tmp_path_factory.mktemp("megatron_native")
    return worker_result([__file__, str(tmp)], tmp)


def test_native_hf_checkpoint_with_ref_load_trains_like_its_bf16_conversion(result):
    assert result["lp_native"] == result["lp_bf16"]
    for a, b in zip(result["chunks_native"], result["chunks_bf16"], strict=True):
        assert [n for n, _ in a] == [n for n, _ in b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_the_engine_decodes_the_same_base_the_trainer_loads(result):
    for lp_engine, lp_trainer in zip(result["lp_engine"], result["lp_native"], strict=True):
        assert lp_engine == pytest.approx(lp_trainer, abs=1e-4)


def test_native_without_ref_load_is_refused_naming_both_ways_out(result):
    message = result["no_ref_load"]
    assert message.startswith("CheckpointError: ")
    assert "is the native MXFP4 checkpoint: the Megatron trainer takes its frozen base from --ref-load" in message
    assert "or give the BF16 conversion as --hf-checkpoint" in message
