"""``k3 convert hf-to-dist`` / ``dist-to-hf`` on CPU (gloo), without the test compatibility module.

hf-to-dist runs under torchrun at TP2 x EP2 in the documented form (``torchrun --nproc-per-node 2 -m k3 convert
hf-to-dist ... --tensor-model-parallel-size 2 --expert-model-parallel-size 2``), so both the TP split and the expert
split are re-sharded at load; the checkpoint then loads into a TP1 model whose every tensor equals the HF one,
and dist-to-hf gives back the HF checkpoint bit for bit.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from k3.checkpoint.hf_io import CheckpointError, load_state_dict
from k3.config import variant


# ---------------------------------------------------------------------------------------------- the worker
def _load_at_tp1(hf_dir: str, dcp_dir: str) -> None:
    """Load the torch_dist checkpoint into a TP1 model; exit non-zero unless every tensor equals the HF one."""
    from k3.checkpoint.names import hf_to_megatron
    from k3.config import K3Config
    from k3.megatron.checkpoint import load_dist, local_shards, shard_of
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.model import k3_model_provider
    from k3.megatron.parallel import destroy_parallel, init_parallel

    cfg = K3Config.from_json(hf_dir)
    init_parallel(ParallelLayout.model_parallel(), seed=None)
    model = k3_model_provider(k3_transformer_config(cfg, params_dtype=torch.bfloat16, dispatcher="allgather",
                                                    perform_initialization=False))
    load_dist(model, dcp_dir)
    want = hf_to_megatron(load_state_dict(hf_dir), cfg)
    shards = local_shards(model)
    bad = [sh.key for sh in shards
           if sh.data.dtype != want[sh.key].dtype or not torch.equal(sh.data, shard_of(want[sh.key], sh))]
    destroy_parallel()
    print(json.dumps({"tensors": len({sh.key for sh in shards}), "expected": len(want), "bad": bad}))


if __name__ == "__main__":
    _load_at_tp1(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def cfg():
    return variant("tiny").replace(quantization_config=None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, cfg):
    from megatron_compat import run_workers

    from k3.checkpoint.synth import write_synthetic_checkpoint

    tmp = tmp_path_factory.mktemp("megatron_convert")
    hf = write_synthetic_checkpoint(cfg, tmp / "hf", "bf16", seed=3, max_shard_size=400_000, progress=False)
    dcp = tmp / "dcp"
    run_workers(["-m", "k3", "convert", "hf-to-dist", "--hf-checkpoint", str(hf), "--save", str(dcp),
                 "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--no-progress",
                 "--save-writers", "3"], nproc=2)
    return tmp, hf, dcp


def test_hf_to_dist_writes_the_release_layout(converted):
    _, _, dcp = converted
    assert (dcp / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    files = {p.name for p in (dcp / "release").iterdir()}
    assert {"metadata.json", ".metadata", "common.pt", "k3_config.json"} <= files
    assert sum(name.endswith(".distcp") for name in files) == 6  # both ranks, 3 writers each (--save-writers 3)


def test_tp2_ep2_checkpoint_loads_at_tp1_equal_to_the_hf_tensors(converted):
    from megatron_compat import run_workers

    _, hf, dcp = converted
    proc = run_workers([__file__, str(hf), str(dcp)], nproc=1)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bad"] == []
    assert report["tensors"] == report["expected"]


def test_dist_to_hf_round_trip_is_bit_exact(converted):
    from megatron_compat import run_workers

    tmp, hf, dcp = converted
    back = tmp / "hf_back"
    run_workers(["-m", "k3", "convert", "dist-to-hf", "--load", str(dcp), "--save", str(back),
                 "--max-shard-size", "300KB", "--no-progress"], nproc=1)
    a, b = load_state_dict(hf, strip_prefix=None), load_state_dict(back, strip_prefix=None)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert b[name].dtype == t.dtype and torch.equal(b[name], t), name
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1  # --max-shard-size is honoured


# ---------------------------------------------------------------------------------------------- bad input
def test_hf_to_dist_refuses_a_save_dir_with_a_checkpoint(converted):
    from k3.megatron.convert import convert_hf_to_dist

    _, hf, dcp = converted
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        convert_hf_to_dist(hf, dcp)


def test_hf_to_dist_refuses_mxfp4_and_names_the_converter(tmp_path, cfg):
    from k3.checkpoint.synth import write_synthetic_checkpoint
    from k3.megatron.convert import convert_hf_to_dist

    native = write_synthetic_checkpoint(variant("tiny"), tmp_path / "native", "mxfp4", progress=False)
    with pytest.raises(CheckpointError, match="mxfp4-to-bf16"):
        convert_hf_to_dist(native, tmp_path / "out")


def test_hf_to_dist_refuses_indivisible_layouts(converted, tmp_path):
    from k3.megatron.convert import convert_hf_to_dist

    _, hf, _ = converted
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by TP=3"):
        convert_hf_to_dist(hf, tmp_path / "out", tp=3)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by EP=3"):
        convert_hf_to_dist(hf, tmp_path / "out", ep=3)


def test_hf_to_dist_refuses_a_checkpoint_with_missing_tensors(converted, tmp_path):
    import shutil

    from k3.megatron.convert import convert_hf_to_dist

    _, hf, _ = converted
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["language_model.model.layers.0.self_attn.A_log"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing.*layers.0.self_attn.A_log"):
        convert_hf_to_dist(broken, tmp_path / "out")


def test_dist_to_hf_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    from k3.megatron.convert import convert_dist_to_hf

    with pytest.raises(CheckpointError, match="not a checkpoint written by k3 convert hf-to-dist"):
        convert_dist_to_hf(tmp_path, tmp_path / "out")


def test_dist_to_hf_refuses_a_non_empty_save_dir(converted, tmp_path):
    from k3.megatron.convert import convert_dist_to_hf

    _, _, dcp = converted
    (tmp_path / "taken.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_dist_to_hf(dcp, tmp_path)


def test_cli_reports_errors_with_exit_code_1(tmp_path):
    from typer.testing import CliRunner

    from k3.launch.checkpoint_commands import convert_app

    result = CliRunner().invoke(convert_app, ["dist-to-hf", "--load", str(tmp_path), "--save",
                                              str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "error:" in result.output and "not a checkpoint" in result.output


def test_save_writers_must_be_at_least_one(converted, tmp_path):
    from k3.megatron.convert import convert_hf_to_dist

    _, hf, _ = converted
    with pytest.raises(ValueError, match=r"^--save-writers 0: expected at least 1$"):
        convert_hf_to_dist(hf, tmp_path / "dcp", writers=0)
    assert not (tmp_path / "dcp").exists()
