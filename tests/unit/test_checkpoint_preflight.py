"""`k3 train --dry-run` and `make acceptance-full DRY_RUN=1` check the recipe's checkpoint pairing before anything
starts: ``--hf-checkpoint`` the native MXFP4 release (the tiny variant in the released layout), ``--ref-load`` its
torch_dist conversion. The recipe page's §4 command line passes with that pair; a ref-load of another shape, a BF16
directory under a native config.json, a torch_dist directory without ``.metadata``, a checkpoint without
``config.json`` and the other planted faults each stop it with one line naming the field or tensor, both values and
both paths, all of them reported together."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint.dist_metadata import dist_checkpoint_files, dist_tensor_shapes, read_dist_metadata
from k3.checkpoint.hf_io import CheckpointError
from k3.config import variant
from k3.launch import train as train_cmd
from k3.launch.checkpoint_checks import config_differences

REPO = Path(__file__).resolve().parents[2]
FAKE_SGLANG = REPO / "tests" / "fake_sglang"

# The recipe page's §4 launch as printed there (the three paths are its placeholders).
RECIPE_LAUNCH = """
  --mode normal --model-variant full --task dapo-math --reward-model deepscaler
  --num-nodes 16 --num-gpus-per-node 4
  --pipeline-parallel-size 8 --context-parallel-size 2
  --rollout-tp-size 16 --rollout-max-concurrency 8
  --lora-rank 32 --lora-alpha 64
  --num-rollout 1000 --rollout-batch-size 8 --n-samples-per-prompt 8
  --rollout-max-response-len 4096 --sglang-max-total-tokens 65536
  --global-batch-size 64 --lr 1e-05 --eval-interval 10
  --distributed-timeout-minutes 60
  --hf-checkpoint <native-mxfp4> --ref-load <torch-dist-dcp>
  --sglang-path /sgl-workspace/sglang/python
  --data-dir <datasets> --enable-wandb
"""


def recipe_argv(native: Path, dcp: Path, data: Path, run_dir: Path) -> list[str]:
    """The §4 line in ``k3 train``'s terms, as ci/acceptance_full.sh translates it: the recipe's backend and engine
    (ours default to torch and embedded), the test-only SGLang tree, W&B left to the cluster, our run directory."""
    words = (RECIPE_LAUNCH.replace("<native-mxfp4>", str(native)).replace("<torch-dist-dcp>", str(dcp))
             .replace("<datasets>", str(data)).replace("/sgl-workspace/sglang/python", str(FAKE_SGLANG)).split())
    return words + ["--backend", "megatron", "--rollout-engine", "sglang", "--no-enable-wandb",
                    "--run-dir", str(run_dir), "--run-id", "recipe"]


@pytest.fixture
def data(tmp_path) -> Path:
    root = tmp_path / "datasets"
    for rel in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text('{"prompt": "1+1", "label": "2"}\n')
    return root


def dry_run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = train_cmd.main(argv + ["--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------- the torch_dist metadata
def test_the_shapes_a_config_implies_are_what_hf_to_dist_writes(checkpoint_pair):
    meta = read_dist_metadata(checkpoint_pair.dcp)
    assert meta.directory == checkpoint_pair.dcp / "release"
    assert meta.shapes == dist_tensor_shapes(variant("tiny"))  # every name, every global shape
    assert meta.shapes["decoder.layers.1.mlp.experts.linear_fc1.weight"] == (8, 64, 32)  # [E, 2F, Lt]
    assert meta.shapes["decoder.layers.0.self_attention.A_log"] == (4,)  # stored padded to 128 on the HF side
    assert meta.config.to_hf_dict() == variant("tiny").replace(quantization_config=None).to_hf_dict()
    assert dist_checkpoint_files(checkpoint_pair.dcp / "release") == meta.directory  # the release dir itself


def test_a_torch_dist_directory_that_is_not_whole_is_named(tmp_path, checkpoint_pair):
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'gone'} does not exist$"):
        dist_checkpoint_files(tmp_path / "gone")
    broken = tmp_path / "dcp"
    shutil.copytree(checkpoint_pair.dcp, broken)
    (broken / "release" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"release has no \.metadata: not a torch_dist checkpoint, or its "
                                              "writing did not finish"):
        read_dist_metadata(broken)
    (broken / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match=r"names '7', but .*iter_0000007 is not a directory"):
        dist_checkpoint_files(broken)


def test_config_differences_name_each_field():
    tiny = variant("tiny")
    assert config_differences(tiny, tiny.replace(quantization_config=None)) == []  # native vs its conversion
    diff = dict((name, (a, b)) for name, a, b in config_differences(tiny, tiny.replace(hidden_size=32)))
    assert diff["text_config.hidden_size"] == (64, 32)


# --------------------------------------------------------------------------- the recipe's launch passes
def test_the_recipe_launch_passes_the_dry_run_with_native_and_its_torch_dist(checkpoint_pair, data, tmp_path,
                                                                           capsys):
    run_dir = tmp_path / "run"
    code, out, err = dry_run(recipe_argv(checkpoint_pair.native, checkpoint_pair.dcp, data, run_dir), capsys)
    assert code == 0, err
    assert err == ""
    assert (f"checkpoint: --hf-checkpoint {checkpoint_pair.native} is native MXFP4 (compressed-tensors "
            "mxfp4-pack-quantized, 192 packed routed-expert weights)") in out
    assert (f"checkpoint: --ref-load {checkpoint_pair.dcp} is a torch_dist checkpoint "
            f"({checkpoint_pair.dcp / 'release'}, 241 tensors) of the same model") in out
    # The tiny checkpoint stands in for the full one: said, not refused.
    assert f"note: --hf-checkpoint {checkpoint_pair.native} is not the full model: num_hidden_layers 9" in out
    assert "expert_model_parallel_size ...................... 8" in out
    assert "dry run: configuration valid, inputs present; not training; nothing written" in out
    assert not run_dir.exists()


def test_make_acceptance_full_dry_run_passes_with_the_pair(checkpoint_pair, data, tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = Path(sys.prefix)
    run_dir = tmp_path / "acceptance"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "RAY_ADDRESS", "DRY_RUN"))}
    # -o install: the target's own install step is not what this tests (and must not touch the venv).
    env.update(BIN=str(venv / "bin"), K3_HF_CHECKPOINT=str(checkpoint_pair.native), K3_REF_LOAD=str(checkpoint_pair.dcp),
               K3_DATA_DIR=str(data), K3_SGLANG_PATH=str(FAKE_SGLANG), K3_RUN_DIR=str(run_dir),
               PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    done = subprocess.run(["make", "-o", "install", "acceptance-full", "DRY_RUN=1", f"VENV={venv}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "is native MXFP4" in done.stdout and "of the same model; the megatron trainer loads" in done.stdout
    assert "acceptance-full: dry run: the launch is valid" in done.stdout and not run_dir.exists()
    # The BF16 conversion is not the recipe's --hf-checkpoint: refused before anything is submitted.
    env["K3_HF_CHECKPOINT"] = str(checkpoint_pair.bf16)
    done = subprocess.run(["make", "-o", "install", "acceptance-full", "DRY_RUN=1", f"VENV={venv}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"K3_HF_CHECKPOINT={checkpoint_pair.bf16} is not the native MXFP4 checkpoint" in done.stderr


# --------------------------------------------------------------------------- planted failures
def test_a_ref_load_of_another_shape_names_the_field_both_values_and_both_paths(checkpoint_pair, data, tmp_path,
                                                                                capsys):
    from checkpoint_pair import write_dist_of_shapes
    from k3.checkpoint.synth import synthetic_config

    shallow = write_dist_of_shapes(tmp_path / "dcp4", synthetic_config("tiny", num_layers=4))
    code, _, err = dry_run(recipe_argv(checkpoint_pair.native, shallow, data, tmp_path / "run"), capsys)
    assert code == 1
    [line] = [x for x in err.splitlines() if "holds another model" in x]
    assert line.startswith(f"k3 train: --ref-load {shallow} holds another model than --hf-checkpoint "
                           f"{checkpoint_pair.native}: ")
    assert (f"text_config.num_hidden_layers: 4 in --ref-load {shallow}/release/k3_config.json, 9 in --hf-checkpoint "
            f"{checkpoint_pair.native}/config.json") in line
    assert (f"tensor decoder.layers.4.input_layernorm.weight missing from --ref-load (--hf-checkpoint "
            f"{checkpoint_pair.native} implies [64])") in line
    assert "differences in all): give the torch_dist conversion of --hf-checkpoint" in line

    wide_cfg = variant("tiny").replace(hidden_size=32, quantization_config=None)
    wide = write_dist_of_shapes(tmp_path / "dcp-h32", wide_cfg)
    code, _, err = dry_run(recipe_argv(checkpoint_pair.native, wide, data, tmp_path / "run"), capsys)
    assert code == 1
    assert (f"text_config.hidden_size: 32 in --ref-load {wide}/release/k3_config.json, 64 in --hf-checkpoint "
            f"{checkpoint_pair.native}/config.json") in err
    assert "differences in all)" in err  # the fields first, then every tensor the width changes


def test_tensor_shapes_are_compared_even_when_the_stored_config_agrees(checkpoint_pair, data, tmp_path, capsys):
    from checkpoint_pair import write_dist_of_shapes

    wide = write_dist_of_shapes(tmp_path / "dcp", variant("tiny").replace(hidden_size=32))
    # A k3_config.json copied from the right model beside the wrong tensors: the shapes still give it away.
    (wide / "release" / "k3_config.json").write_text(json.dumps(variant("tiny").to_hf_dict()))
    code, _, err = dry_run(recipe_argv(checkpoint_pair.native, wide, data, tmp_path / "run"), capsys)
    assert code == 1 and "text_config." not in err
    assert "tensor decoder.final_layernorm.weight: [32] in --ref-load" in err


def test_a_bf16_directory_under_a_native_config_is_refused(checkpoint_pair, data, tmp_path, capsys):
    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoint_pair.bf16, mixed)
    shutil.copy(checkpoint_pair.native / "config.json", mixed / "config.json")
    code, _, err = dry_run(recipe_argv(mixed, checkpoint_pair.dcp, data, tmp_path / "run"), capsys)
    assert code == 1
    assert (f"--hf-checkpoint {mixed}: config.json declares the native MXFP4 checkpoint (quantization_config, format "
            "'mxfp4-pack-quantized'), but no weight is stored packed: the routed experts are BF16 (e.g. "
            "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight)") in err
    # …and the other way round: packed shards under the BF16 config.json.
    shutil.copytree(checkpoint_pair.native, tmp_path / "unlabelled")
    shutil.copy(checkpoint_pair.bf16 / "config.json", tmp_path / "unlabelled" / "config.json")
    code, _, err = dry_run(recipe_argv(tmp_path / "unlabelled", checkpoint_pair.dcp, data, tmp_path / "run"), capsys)
    assert code == 1 and "192 weights are stored packed MXFP4" in err and "config.json has no quantization_config" in err


def test_missing_metadata_config_or_stored_config_are_named(checkpoint_pair, data, tmp_path, capsys):
    no_meta = tmp_path / "no-meta"
    shutil.copytree(checkpoint_pair.dcp, no_meta)
    (no_meta / "release" / ".metadata").unlink()
    no_config = tmp_path / "no-config"
    shutil.copytree(checkpoint_pair.native, no_config)
    (no_config / "config.json").unlink()
    code, _, err = dry_run(recipe_argv(checkpoint_pair.native, no_meta, data, tmp_path / "run"), capsys)
    assert code == 1
    assert (f"--ref-load {no_meta}: {no_meta / 'release'} has no .metadata: not a torch_dist checkpoint, or its "
            "writing did not finish: pass the torch_dist checkpoint `k3 convert hf-to-dist` writes") in err
    code, _, err = dry_run(recipe_argv(no_config, checkpoint_pair.dcp, data, tmp_path / "run"), capsys)
    assert code == 1 and f"--hf-checkpoint {no_config} has no config.json" in err
    no_k3_config = tmp_path / "no-k3-config"
    shutil.copytree(checkpoint_pair.dcp, no_k3_config)
    (no_k3_config / "release" / "k3_config.json").unlink()
    code, _, err = dry_run(recipe_argv(checkpoint_pair.native, no_k3_config, data, tmp_path / "run"), capsys)
    assert code == 1 and "k3_config.json is missing, so the trainer cannot tell which model it holds" in err


def test_shards_that_do_not_hold_the_configured_model_are_named(checkpoint_pair, data, tmp_path, capsys):
    wrong = tmp_path / "wrong-vocab"
    shutil.copytree(checkpoint_pair.bf16, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["text_config"]["vocab_size"] = 1024
    (wrong / "config.json").write_text(json.dumps(config))
    argv = ["--model-variant", "tiny", "--task", "dapo-math", "--hf-checkpoint", str(wrong), "--data-dir", str(data),
            "--run-dir", str(tmp_path / "run")]
    code, _, err = dry_run(argv, capsys)
    assert code == 1
    assert (f"--hf-checkpoint {wrong}: the shards do not hold the model config.json describes: "
            "language_model.model.embed_tokens.weight: shape [512, 64] in the shards, [1024, 64] by config.json") in err


def test_the_backend_must_take_the_checkpoint(checkpoint_pair, data, tmp_path, capsys):
    tiny = ["--model-variant", "tiny", "--task", "dapo-math", "--data-dir", str(data), "--run-dir",
            str(tmp_path / "run"), "--hf-checkpoint", str(checkpoint_pair.native)]
    # megatron trains a BF16 base: the native checkpoint alone cannot be its base.
    code, _, err = dry_run(tiny + ["--backend", "megatron", "--num-gpus-per-node", "1"], capsys)
    assert code == 1
    assert (f"--hf-checkpoint {checkpoint_pair.native} is the native MXFP4 checkpoint and --backend megatron trains a "
            "BF16 base: pass its torch_dist conversion as --ref-load") in err
    code, _, err = dry_run(tiny + ["--backend", "megatron", "--num-gpus-per-node", "1", "--ref-load",
                                   str(checkpoint_pair.dcp)], capsys)
    assert code == 0, err
    # The torch trainer decodes the native experts on load: it takes the checkpoint, and says how.
    code, out, err = dry_run(tiny, capsys)
    assert code == 0, err
    assert "checkpoint: the torch trainer decodes the routed experts to BF16 on load" in out


def test_every_problem_is_reported_in_one_run(checkpoint_pair, data, tmp_path, capsys):
    no_meta = tmp_path / "no-meta"
    shutil.copytree(checkpoint_pair.dcp, no_meta)
    (no_meta / "release" / ".metadata").unlink()
    (data / "aime-2024" / "aime-2024.jsonl").unlink()
    (tmp_path / "a-file").write_text("")
    argv = recipe_argv(checkpoint_pair.native, no_meta, data, tmp_path / "a-file" / "run")
    argv[argv.index("--backend") + 1] = "torch"
    code, out, err = dry_run(argv + ["--ref-load", str(no_meta)], capsys)
    assert code == 1
    problems = [line for line in err.splitlines() if line.startswith("k3 train: ")]
    for expected in ("eval data", "--backend torch trains on one rank, but this layout has 64 training ranks",
                     "--ref-load " + str(no_meta) + " is applied only with --backend megatron (this run: --backend "
                     "torch): add --backend megatron, or drop --ref-load",
                     f"--run-dir {tmp_path / 'a-file' / 'run'}: {tmp_path / 'a-file'} is not a directory"):
        assert any(expected in p for p in problems), (expected, problems)
    assert "dry run: configuration valid" not in out and f"{len(problems)} problem(s) above" in out
