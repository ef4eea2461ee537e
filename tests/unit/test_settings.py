"""The typed run settings (``k3.settings``): pure data at the bottom of the house, one parallel layout, each
default and list of choices declared once, and the sections the launcher builds equal to the dumped values."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

from k3.launch.args import TrainArgs, resolve
from k3.launch.resolved_keys import NOT_PRINTED, resolved_value
from k3.settings.colocate import OFFLOAD_ROLLOUT_LEVELS, PEAK_DEVICES
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import ROLLOUT_MAX_CONCURRENCY, SGLANG_PATH
from k3.settings.train import BACKENDS, EXPERT_LORA_KERNELS

SETTINGS = Path(__file__).resolve().parents[2] / "k3" / "settings"


def test_settings_import_only_the_standard_library_and_k3_config():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for path in sorted(SETTINGS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] not in stdlib and n != "k3.config" and not n.startswith("k3.settings")]
    assert found == []


def test_model_parallel_layout_has_short_names():
    layout = ParallelLayout.model_parallel(tp=2, ep=4, pp=2, cp=1, first_stage_layers=5, last_stage_layers=4)
    assert (layout.tp, layout.ep, layout.pp, layout.cp) == (2, 4, 2, 1)
    assert (layout.first_stage_layers, layout.last_stage_layers) == (5, 4)
    assert layout.sequence_parallel and layout.expert_tensor_parallel_size == 1
    assert layout.world_size is None and layout.data_parallel_size is None and layout.rollout_tp_size is None
    assert not ParallelLayout.model_parallel().sequence_parallel


def test_the_launcher_layout_is_the_same_type():
    layout = resolve(TrainArgs(model_variant="full", num_nodes=16, num_gpus_per_node=4, run_id="t",
                               ipc_unlink_shim=False, pipeline_parallel_size=8, context_parallel_size=2)).layout
    assert isinstance(layout, ParallelLayout)
    assert (layout.tp, layout.ep, layout.pp, layout.cp) == (4, 8, 8, 2)
    assert (layout.first_stage_layers, layout.last_stage_layers) == (12, 9)


@pytest.mark.parametrize("make, message", [
    (lambda: ParallelLayout.model_parallel(tp=0), r"ParallelLayout\.tp=0: expected an integer >= 1"),
    (lambda: ParallelLayout.model_parallel(ep=-1), r"ParallelLayout\.ep=-1: expected an integer >= 1"),
    (lambda: ParallelLayout.model_parallel(pp=True), r"ParallelLayout\.pp=True: expected an integer >= 1"),
    (lambda: ParallelLayout.model_parallel(cp=1.5), r"ParallelLayout\.cp=1\.5: expected an integer >= 1"),
    (lambda: ParallelLayout(expert_tensor_parallel_size=0), r"ParallelLayout\.etp=0"),
    (lambda: ParallelLayout(world_size=0), r"ParallelLayout\.world_size=0"),
    (lambda: ParallelLayout(data_parallel_size=0), r"ParallelLayout\.dp=0"),
    (lambda: ParallelLayout(rollout_tp_size=0), r"ParallelLayout\.rollout_tp_size=0"),
    (lambda: ParallelLayout.model_parallel(last_stage_layers=3),
     r"ParallelLayout\.last_stage_layers=3: expected None, or an integer >= 1 with pp > 1"),
    (lambda: ParallelLayout.model_parallel(pp=2, first_stage_layers=0),
     r"ParallelLayout\.first_stage_layers=0: expected None, or an integer >= 1 with pp > 1"),
])
def test_bad_layouts_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_defaults_and_choices_are_declared_once():
    flags = {f.name: f for f in dataclasses.fields(TrainArgs)}
    assert flags["rollout_max_concurrency"].default == ROLLOUT_MAX_CONCURRENCY == 64
    assert flags["sglang_path"].default == SGLANG_PATH
    assert flags["colocate_memory_peak_device"].metadata["choices"] == PEAK_DEVICES
    assert flags["offload_rollout_level"].metadata["choices"] == OFFLOAD_ROLLOUT_LEVELS
    assert flags["backend"].metadata["choices"] == BACKENDS
    assert flags["expert_lora_kernel"].metadata["choices"] == EXPERT_LORA_KERNELS
    from k3.rl import colocate

    assert "PEAK_DEVICES" not in colocate.__all__  # the schedule checks against the settings' tuple


def test_the_run_settings_carry_the_dumped_values():
    """Every settings field named like a dump key holds the dumped value: the parts read what the run prints."""
    resolved = resolve(TrainArgs(model_variant="tiny", run_id="t", hf_checkpoint="/ckpt", lr=3e-5, mode="normal",
                                 colocate_memory_peak_device="cpu", offload_rollout_level=["kv_cache", "weight"]))
    dump, s = resolved.to_dict(), resolved.settings
    for section in (s.layout, s.optimizer, s.grpo, s.rollout, s.data, s.colocate, s.training):
        for key, value in dataclasses.asdict(section).items():
            if key in NOT_PRINTED:  # nothing applies it, so it is not printed (k3.launch.resolved_keys)
                assert key not in dump, key
                continue
            # a key another backend or engine applies prints its off value (only_with)
            assert dump[key] == resolved_value(key, list(value) if isinstance(value, tuple) else value, dump), key
    assert (s.run_id, s.seed, s.num_rollout, s.rollout_batch_size, s.n_samples_per_prompt, s.global_batch_size) == (
        "t", 1234, 3000, 32, 8, 256)
    assert (s.tokenizer_path, s.reward_model, s.rollout_engine, s.optimizer.lr) == ("/ckpt", "math", "embedded", 3e-5)
    assert (s.lora.rank, s.lora.alpha, s.lora.target_modules) == (16, 32.0, tuple(TrainArgs().target_modules))
    assert s.colocate.offload_rollout_level == ("kv_cache", "weight") and not s.uses_gpus
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]
