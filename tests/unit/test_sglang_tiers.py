"""The two GPU tiers' entry scripts on a machine without their hardware: they stop at once, start nothing, and say
what is missing (ci/smoke_4layer.sh, ci/acceptance_full.sh); their dry runs validate the launch and print the
resolved lines the harness checks."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_SGLANG = REPO / "tests" / "fake_sglang"
RESOLVED_LINES = ("expert_model_parallel_size", "max_tokens_per_gpu", "colocate_memory_peak_device",
                  "lora_base_cpu_backup")


def _has_8_gpus() -> bool:
    try:
        import torch

        return bool(shutil.which("nvidia-smi")) and torch.cuda.device_count() >= 8
    except Exception:  # noqa: BLE001
        return False


def _script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "RAY_ADDRESS", "DRY_RUN"))}
    base["PATH"] = f"{REPO / '.venv' / 'bin'}:{base.get('PATH', '')}"
    return subprocess.run(["bash", str(REPO / "ci" / name), *args], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def inputs(tmp_path):
    """Paths that pass the scripts' checks: a checkpoint dir, a torch_dist dir, the datasets."""
    ckpt, dcp, data = tmp_path / "ckpt", tmp_path / "dcp", tmp_path / "data"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    dcp.mkdir()
    for f in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (data / f).parent.mkdir(parents=True)
        (data / f).write_text('{"prompt": "1+1", "label": "2"}\n')
    return {"K3_HF_CHECKPOINT": str(ckpt), "K3_REF_LOAD": str(dcp), "K3_DATA_DIR": str(data)}


def test_smoke_4layer_dry_run_without_paths_lists_every_problem():
    out = _script("smoke_4layer.sh", "--dry-run")
    assert out.returncode == 1, out.stdout + out.stderr
    for line in ("K3_HF_CHECKPOINT is not set", "K3_REF_LOAD is not set", "K3_DATA_DIR is not set",
                 "nothing was started"):
        assert line in out.stderr
    if not _has_8_gpus():
        assert "smoke-4layer needs 8" in out.stderr or "nvidia-smi not found" in out.stderr


@pytest.mark.skipif(_has_8_gpus(), reason="this machine has the tier's 8 GPUs")
def test_smoke_4layer_without_gpus_stops_before_training(inputs, tmp_path):
    run = tmp_path / "run"
    out = _script("smoke_4layer.sh", K3_SMOKE_RUN_DIR=str(run), K3_SGLANG_PATH=str(FAKE_SGLANG), **inputs)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "nothing was started" in out.stderr and "not set" not in out.stderr
    assert "GPU" in out.stderr or "CUDA" in out.stderr
    # The plan was resolved (the lines the 4layer spec checks), the run directory never made.
    for key in RESOLVED_LINES:
        assert key in out.stdout
    assert "max_tokens_per_gpu .............................. 512" in out.stdout
    assert not run.exists()


def test_acceptance_full_without_a_cluster_submits_nothing():
    out = _script("acceptance_full.sh")
    assert out.returncode == 2 and "no Ray cluster: set RAY_ADDRESS" in out.stderr
    assert "Nothing was submitted" in out.stderr
    out = _script("acceptance_full.sh", RAY_ADDRESS="http://127.0.0.1:9")
    assert out.returncode == 2 and "set K3_HF_CHECKPOINT" in out.stderr


def test_acceptance_full_checks_the_paths_it_is_given(inputs, tmp_path):
    missing = {**inputs, "K3_DATA_DIR": str(tmp_path / "nowhere")}
    out = _script("acceptance_full.sh", RAY_ADDRESS="http://127.0.0.1:9", **missing)
    assert out.returncode == 2 and "has no dapo-math-17k/dapo-math-17k.jsonl" in out.stderr
    out = _script("acceptance_full.sh", RAY_ADDRESS="http://127.0.0.1:9", **{**inputs, "K3_REF_LOAD": "/nope"})
    assert out.returncode == 2 and "K3_REF_LOAD=/nope does not exist" in out.stderr


def test_acceptance_full_dry_run_validates_the_recipe_launch(checkpoint_pair, inputs, tmp_path):
    # The recipe's pairing: the native MXFP4 checkpoint and its torch_dist conversion (the dry run reads both).
    inputs = {**inputs, "K3_HF_CHECKPOINT": str(checkpoint_pair.native), "K3_REF_LOAD": str(checkpoint_pair.dcp)}
    run = tmp_path / "acceptance"
    out = _script("acceptance_full.sh", "--dry-run", K3_RUN_DIR=str(run), K3_SGLANG_PATH=str(FAKE_SGLANG),
                  **inputs)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TP4 × CP2 × PP8 × DP1 = 64 GPU ranks, EP8" in out.stdout and "rollout 4 × TP16/EP1" in out.stdout
    for line in ("expert_model_parallel_size ...................... 8",
                 "max_tokens_per_gpu .............................. 8192",
                 "colocate_memory_peak_device ..................... gpu",
                 "lora_base_cpu_backup ............................ True"):
        assert line in out.stdout
    assert "dry run: the launch is valid" in out.stdout and not run.exists()
    # A flag the launch cannot take stops it the same way.
    out = _script("acceptance_full.sh", "--dry-run", K3_RUN_DIR=str(run), K3_SGLANG_PATH=str(FAKE_SGLANG),
                  K3_EXTRA_TRAIN_ARGS="--rollout-tp-size 5", **inputs)
    assert out.returncode == 2 and "rejected the launch" in out.stderr and "--rollout-tp-size 5" in out.stdout + \
        out.stderr
