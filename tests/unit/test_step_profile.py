"""``--profile-train-step``: one optimizer step under torch.profiler, summarised with what launched each entry
(k3/rl/step_profile.py), the flag checked at launch, and a trainer rank writing its summary at that step only."""

from __future__ import annotations

import json

import pytest
import torch
from layout_parity import trajectories
from tiny_checkpoint import write_tiny_checkpoint

from k3.kernels.grouped_mm import grouped_mm_reference
from k3.launch.args import LaunchConfigError, TrainArgs, resolve
from k3.lora import LoRAConfig
from k3.rl.grpo import GRPOConfig
from k3.rl.step_profile import profile_call, summary_text, write_profile
from k3.settings.train import TrainingSettings
from k3.settings.worker import WorkerSpec


X, W, COUNTS = torch.randn(1536, 512), torch.randn(3, 768, 512), torch.tensor([512, 512, 512])


def _work() -> torch.Tensor:  # three GEMMs of 512 × 512 × 768: the costliest operator by far
    return grouped_mm_reference(X, W, COUNTS).sum()


def test_a_profiled_call_returns_its_result_and_names_the_code_behind_its_costliest_operators():
    want = _work()
    got, summary = profile_call(_work, top=8)
    assert torch.equal(got, want)  # the call ran as it runs unprofiled
    assert summary["unit"] == "cpu" and summary["wall_s"] > 0 and 3 <= len(summary["rows"]) <= 8
    assert sum(r["share"] for r in summary["rows"]) <= 1.0 + 1e-9
    assert [r["ms"] for r in summary["rows"]] == sorted((r["ms"] for r in summary["rows"]), reverse=True)
    mm = summary["rows"][0]
    assert (mm["name"], mm["calls"]) == ("aten::mm", 3)
    assert mm["launched_by"][0]["by"].startswith("aten::mm [[512, 512], [512, 768]] at k3/kernels/grouped_mm.py(")
    assert mm["launched_by"][0]["by"].endswith("): grouped_mm_reference")
    text = summary_text(summary, "demo")
    assert text.startswith("demo: ") and "aten::mm" in text and "at k3/kernels/grouped_mm.py" in text


def test_the_summary_is_written_as_json_and_text(tmp_path):
    _, summary = profile_call(_work, top=3)
    path = write_profile(summary, tmp_path / "profile", "train_step_1_rank0", "step 1")
    assert path == tmp_path / "profile" / "train_step_1_rank0.txt" and path.read_text().startswith("step 1: ")
    assert json.loads((tmp_path / "profile" / "train_step_1_rank0.json").read_text()) == json.loads(
        json.dumps(summary))


@pytest.mark.parametrize("step, match", [
    (4, r"--profile-train-step 4: this run makes 4 optimizer steps \(--num-rollout 4 × 1 per rollout\): use 0 to 3"),
    (-1, r"--profile-train-step -1: this run makes 4 optimizer steps"),
])
def test_a_step_the_run_never_makes_is_refused_at_launch(step, match):
    with pytest.raises(LaunchConfigError, match=match):
        resolve(TrainArgs(model_variant="tiny", num_rollout=4, profile_train_step=step, run_id="p"))


def test_the_flag_reaches_the_training_settings_and_the_settings_check_it():
    r = resolve(TrainArgs(model_variant="tiny", num_rollout=4, profile_train_step=2, run_id="p"))
    assert r.settings.training.profile_train_step == 2
    assert r.args.profile_train_step == 2
    with pytest.raises(ValueError, match="profile_train_step=True: expected an optimizer step index >= 0"):
        TrainingSettings(1, True, -1, "full", "uniform", 1, False, "x", profile_train_step=True)


def test_a_trainer_rank_profiles_exactly_the_step_it_was_given(tmp_path):
    from k3.rl.trainer_worker import TrainerWorker

    base = write_tiny_checkpoint(tmp_path / "base")
    spec = WorkerSpec(model_dir=str(base), lora=LoRAConfig(rank=4, alpha=8.0), seed=3, profile_train_step=1,
                      profile_dir=str(tmp_path / "profile"))
    worker = TrainerWorker(spec, GRPOConfig(lr=5e-3), 64, rank=2)
    trajs = trajectories(worker.policy.model.config.vocab_size)
    old = worker.log_probs(trajs)
    for t, lp in zip(trajs, old):
        t.old_log_probs = lp
    worker.train_step(trajs)
    assert not (tmp_path / "profile").exists()  # step 0 ran unprofiled
    stats = worker.train_step(trajs)
    assert set(stats) >= {"train/loss", "train/grad_norm"} and stats["perf/profiled_step"] == 1.0
    text = (tmp_path / "profile" / "train_step_1_rank2.txt").read_text()
    assert text.startswith(f"optimizer step 1, trainer rank 2, {len(trajs)} samples: ")
    assert (tmp_path / "profile" / "train_step_1_rank2.json").is_file()
    worker.train_step(trajs)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["train_step_1_rank2.json",
                                                                         "train_step_1_rank2.txt"]


def test_on_cuda_the_step_after_the_profiled_one_records_memory_and_never_under_the_profiler(tmp_path, monkeypatch):
    import k3.rl.trainer_worker as tw

    base = write_tiny_checkpoint(tmp_path / "base")
    spec = WorkerSpec(model_dir=str(base), lora=LoRAConfig(rank=4, alpha=8.0), seed=3, profile_train_step=0,
                      profile_dir=str(tmp_path / "profile"))
    worker = tw.TrainerWorker(spec, GRPOConfig(lr=5e-3), 64, rank=1)
    trajs = trajectories(worker.policy.model.config.vocab_size)
    for t, lp in zip(trajs, worker.log_probs(trajs)):
        t.old_log_probs = lp
    profiling = []  # whether the profiler was running at each record (the H100's SystemError came from both)
    real_profile_call = tw.profile_call

    def watched_profile_call(fn):
        profiling.append("profiler")
        try:
            return real_profile_call(fn)
        finally:
            profiling.pop()

    def recording(fn):  # stands in for the CUDA recorder: what it would report
        recorded.append(list(profiling))
        return fn(), {"reserved_mb": 4.0, "live_mb": 2.0, "made_in_step_mb": 2.0, "made_in_step_blocks": 1,
                      "by_holder": [{"holder": "Policy.cache", "what": "[1] float32", "mb": 2.0, "blocks": 1,
                                    "largest_mb": 2.0, "in_step_mb": 2.0}]}

    recorded: list[list[str]] = []
    monkeypatch.setattr(tw, "profile_call", watched_profile_call)
    monkeypatch.setattr(tw, "record_step_memory", recording)
    assert worker.train_step(trajs)["perf/profiled_step"] == 0.0
    assert recorded == []
    assert worker.train_step(trajs)["perf/profiled_step"] == 1.0
    assert recorded == [[]]  # step 1 alone, with no profiler around it
    assert "perf/profiled_step" not in worker.train_step(trajs)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "train_step_0_rank1.json", "train_step_0_rank1.txt",
        "train_step_1_memory_rank1.json", "train_step_1_memory_rank1.txt"]
    text = (tmp_path / "profile" / "train_step_1_memory_rank1.txt").read_text()
    assert text.startswith(f"optimizer step 1, trainer rank 1, {len(trajs)} samples\n\nleft allocated in the "
                           "default pool after the step: 2.0 MiB live in 4.0 MiB of segments")


def test_a_worker_spec_that_would_profile_without_a_folder_is_refused():
    with pytest.raises(ValueError, match="profile_train_step=1 needs profile_dir"):
        WorkerSpec(model_dir="m", lora=LoRAConfig(rank=4, alpha=8.0), profile_train_step=1)
    assert WorkerSpec(model_dir="m", lora=LoRAConfig(rank=4, alpha=8.0)).profile_dir is None
