"""The recipe's checkpoint pairing in tiny, for tests of the launch (test-only): a native MXFP4 checkpoint in the
released layout, its BF16 conversion and the torch_dist conversion of that, made as a user makes them
(``k3 convert mxfp4-to-bf16``, then ``k3 convert hf-to-dist`` under torchrun on one gloo rank); and a torch_dist
checkpoint of any K3 config written straight from its shapes (``write_dist_of_shapes``), for planted mismatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CheckpointPair:
    native: Path  # --hf-checkpoint: the release's layout (compressed-tensors mxfp4-pack-quantized)
    bf16: Path  # its `k3 convert mxfp4-to-bf16` output
    dcp: Path  # --ref-load: `k3 convert hf-to-dist` of bf16 (SAVE with the tracker and release/)


def make_checkpoint_pair(root: Path, seed: int = 11) -> CheckpointPair:
    from k3.checkpoint.convert import convert_mxfp4_to_bf16
    from k3.checkpoint.synth import write_synthetic_checkpoint
    from k3.config import variant

    native = write_synthetic_checkpoint(variant("tiny"), root / "native", "mxfp4", seed=seed, progress=False)
    bf16 = root / "bf16"
    convert_mxfp4_to_bf16(native, bf16, workers=1, progress=False)
    dcp = root / "dcp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "k3", "convert", "hf-to-dist", "--hf-checkpoint", str(bf16), "--save", str(dcp),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return CheckpointPair(native, bf16, dcp)


def write_dist_of_shapes(save: Path, cfg) -> Path:
    """A torch_dist checkpoint of ``cfg`` laid out as ``k3 convert hf-to-dist`` lays it out (tracker, release/ with
    ``.metadata``, megatron's ``metadata.json`` and ``k3_config.json``), its tensors zeros of the shapes
    ``dist_tensor_shapes(cfg)`` gives (``tests/unit/test_checkpoint_preflight.py`` checks those against a real
    conversion). Returns ``save``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from k3.checkpoint.dist_metadata import dist_tensor_shapes

    release = save / "release"
    release.mkdir(parents=True)
    state = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in dist_tensor_shapes(cfg).items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(release)), no_dist=True)
    (release / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))
    (release / "k3_config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (save / "latest_checkpointed_iteration.txt").write_text("release\n")
    return save
