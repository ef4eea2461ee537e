"""The colocated memory hand-off as the loop runs it (``k3.rl.colocate``, ``k3.rl.loop``), in process on CPU with the
torch trainer and the embedded engine: the exact sequence of trainer and engine calls over two rollouts in both
``--colocate-memory-peak-device`` orders (the recipe's lists, §5.3–5.4) and without ``--offload-train``; the memory
events of every move; a wake_up that fails stops the run; what the loop refuses before it starts. (The SGLang
engine's side of the same orders: tests/unit/test_loop_sglang.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from tiny_checkpoint import write_tiny_run_inputs

from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.launch.train import main as train_main
from k3.rl import loop as loop_mod
from k3.rl.handles import LocalHandle
from k3.rl.metrics import MetricsWriter
from k3.rl.trainer_worker import TrainerWorker
from k3.rl.trainers.memory_regions import ParamGrads
from k3.rollout.embedded.worker import EngineWorker

TRAINER_CALLS = ("sleep", "wake_up", "offload_grad_buffer", "clear_memory", "log_probs", "train_step",
                 "update_weights", "save_adapter")
ENGINE_CALLS = ("generate", "release_memory", "resume_memory")
ALL, KV, W = "kv_cache,cuda_graph,weights", "kv_cache,cuda_graph", "weights"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("colocate_loop"))


def _argv(root, run, *extra):
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "4", "--lr", "1e-3", "--save-interval", "1",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run), *extra]


def _events(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def timeline(monkeypatch):
    """Every trainer and engine call the loop makes, in order (``trainer.sleep``, ``engine.release weights``…)."""
    calls: list[str] = []

    def wrap(cls, method, who):
        original = getattr(cls, method)

        def recording(self, *args, _original=original):
            tags = f" {','.join(args[0])}" if method in ("release_memory", "resume_memory") else ""
            calls.append(f"{who}.{method}{tags}")
            return _original(self, *args)

        monkeypatch.setattr(cls, method, recording)

    for method in TRAINER_CALLS:
        wrap(TrainerWorker, method, "trainer")
    for method in ENGINE_CALLS:
        wrap(EngineWorker, method, "engine")
    return calls


def expected_calls(peak: str | None) -> list[str]:
    """The recipe's order for 2 rollouts on an engine that allocates per call (nothing released at start), a
    checkpoint after each rollout; ``peak`` None: without --offload-train (cpu peak)."""
    sync = ["trainer.update_weights", f"engine.resume_memory {KV}"]
    if peak is None:
        startup = ["trainer.update_weights"]
        rollout = ["engine.generate", f"engine.release_memory {ALL}", "trainer.log_probs", "trainer.train_step",
                   f"engine.resume_memory {W}", *sync]
    elif peak == "cpu":
        startup = ["trainer.sleep", "trainer.update_weights"]
        rollout = ["engine.generate", f"engine.release_memory {ALL}", "trainer.wake_up", "trainer.log_probs",
                   "trainer.train_step", "trainer.sleep", f"engine.resume_memory {W}", *sync]
    else:
        startup = ["trainer.sleep", "trainer.update_weights"]
        rollout = ["engine.generate", f"engine.release_memory {KV}", "trainer.wake_up", f"engine.release_memory {W}",
                   "trainer.log_probs", "trainer.train_step", "trainer.clear_memory", "trainer.offload_grad_buffer",
                   f"engine.resume_memory {W}", "trainer.sleep", *sync]
    return [*startup, *rollout, "trainer.save_adapter", *rollout, "trainer.save_adapter"]


@pytest.mark.parametrize("peak", ["cpu", "gpu", None], ids=["cpu-peak", "gpu-peak", "no-offload-train"])
def test_the_loop_hands_memory_over_in_the_recipes_order(tiny, monkeypatch, timeline, peak):
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    run = tiny / f"run-{peak}"
    flags = ["--colocate-memory-peak-device", peak or "cpu"] + (["--no-offload-train"] if peak is None else [])
    assert train_main(_argv(tiny, run, *flags)) == 0
    assert timeline == expected_calls(peak)
    ev = _events(run)
    assert ev[-1]["status"] == "finished"
    assert json.loads((run / "resolved_config.json").read_text())["offload_train"] is (peak is not None)
    (line,) = [x for x in (run / "resolved_config.txt").read_text().splitlines() if x.split()[:1] == ["offload_train"]]
    assert line.endswith(str(peak is not None))

    # the moves' durations: before training (engines release, trainer wakes) and before each sync
    assert all(e["perf/offload_time"] > 0 for e in ev if e["event"] == "train")
    assert [("perf/onload_time" in e) for e in ev if e["event"] == "sync"] == [False, True, True]
    mem = [e for e in ev if e["event"] == "memory"]
    trainer = [e for e in mem if "rank" in e]
    engine = [e for e in mem if "engine" in e]
    # every move is bracketed: one reading before and one after, with the sync it precedes or belongs to
    moves = [(e["phase"], e["sync"], e["rollout_id"]) for e in trainer if "update_weights" not in e["phase"]]
    if peak is None:
        assert moves == []
    else:
        rollout = ([("before_wake_up", s, r), ("after_wake_up", s, r)] +
                   ([("before_offload_grad_buffer", s, r), ("after_offload_grad_buffer", s, r)] if peak == "gpu"
                    else []) + [("before_offload", s, r), ("after_offload", s, r)] for s, r in ((1, 0), (2, 1)))
        assert moves == [("before_offload", 0, None), ("after_offload", 0, None), *[m for r in rollout for m in r]]
        # CPU: the allocated reading is the trainer's resident parameters + gradient buffers; asleep only the
        # adapters stay (rank 16 on the tiny model: a quarter of it), the same bytes at every sleep
        asleep = {e["memory/allocated_gb"] for e in trainer if e["phase"] == "after_offload"}
        awake = {e["memory/allocated_gb"] for e in trainer if e["phase"] == "after_wake_up"}
        assert len(asleep) == 1 and len(awake) == 1 and asleep.pop() < 0.3 * awake.pop()
        # the sync ran with the trainer asleep
        assert {e["memory/allocated_gb"] for e in trainer if e["phase"] == "before_update_weights"} == \
            {e["memory/allocated_gb"] for e in trainer if e["phase"] == "after_offload"}
    assert all(e["rank"] == 0 and e["memory/physical_gb"] > 0 for e in trainer)
    for phase in ("before_update_weights", "after_update_weights", "after_update_weights_cleanup"):
        assert [e["sync"] for e in trainer if e["phase"] == phase] == [0, 1, 2]

    releases = [(e["phase"], e["tags"], e["sync"], e["memory/engine_weights_resident"]) for e in engine]
    if peak == "gpu":
        kv = ["kv_cache", "cuda_graph"]
        per = [("before_release", kv, True), ("after_release", kv, True),
               ("before_release", ["weights"], True), ("after_release", ["weights"], False),
               ("before_resume", ["weights"], False), ("after_resume", ["weights"], True)]
    else:
        per = [("before_release", ["kv_cache", "cuda_graph", "weights"], True),
               ("after_release", ["kv_cache", "cuda_graph", "weights"], False),
               ("before_resume", ["weights"], False), ("after_resume", ["weights"], True)]
    per += [("before_resume", ["kv_cache", "cuda_graph"], True), ("after_resume", ["kv_cache", "cuda_graph"], True)]
    assert releases == [(p, t, s, w) for s in (1, 2) for p, t, w in per]
    assert all(e["engine"] == 0 and "rank" not in e and e["memory/physical_gb"] > 0 for e in engine)

    # the harness reads the run (engine readings included) without a problem, and judges its memory
    from harness.readers import read_run

    data = read_run(run, finished=True)
    assert data.problems == []


def test_a_wake_up_that_fails_stops_the_run_naming_rank_and_phase(tiny, monkeypatch, capsys):
    monkeypatch.setenv("K3_IN_PROCESS", "1")

    def planted(self, regions):
        raise RuntimeError("planted: the gradient buffers cannot come back")

    monkeypatch.setattr(ParamGrads, "restore", planted)
    run = tiny / "wake-fails"
    assert train_main(_argv(tiny, run)) == 1
    err = capsys.readouterr().err
    assert ("the trainer's wake_up failed (TrainerMemoryError: trainer rank 0: wake_up failed while resuming the "
            "gradient buffers: RuntimeError: planted: the gradient buffers cannot come back (the trainer is back "
            "asleep, nothing half-resumed)); the run stops here") in err
    ev = _events(run)
    assert ev[-1]["status"] == "failed" and "wake_up failed while resuming the gradient buffers" in ev[-1]["error"]
    # nothing ran on a half-woken model: no log-probs, no step, no second sync
    assert not [e for e in ev if e["event"] == "train"] and len([e for e in ev if e["event"] == "sync"]) == 1
    phases = [e["phase"] for e in ev if e["event"] == "memory" and "rank" in e]
    assert phases[-1] == "after_update_weights_cleanup" and "after_wake_up" not in phases


def _settings(tiny, tmp_path, *extra):
    return resolve(parse_train_args(_argv(tiny, tmp_path / "run", *extra), environ={})).settings


def test_offload_train_needs_a_trainer_with_the_memory_steps(tiny, tmp_path):
    class Resident:  # a trainer that keeps its memory resident
        def update_weights(self, version):
            raise AssertionError("never reached")

    settings = _settings(tiny, tmp_path)
    writer = MetricsWriter(tmp_path / "run")
    try:
        with pytest.raises(loop_mod.TrainingError, match="--offload-train needs a trainer with sleep, wake_up, "
                                                         "offload_grad_buffer, clear_memory; this one has no sleep, "
                                                         r"wake_up, offload_grad_buffer, clear_memory \(pass "
                                                         "--no-offload-train to keep it resident\\)"):
            loop_mod.Loop(settings, LocalHandle(Resident()), [LocalHandle(object())], writer)
        off = dataclasses.replace(settings, colocate=dataclasses.replace(settings.colocate, offload_train=False))
        loop_mod.Loop(off, LocalHandle(Resident()), [LocalHandle(object())], writer)  # nothing to move: fine
    finally:
        writer.close()


def test_a_separate_host_weight_backup_is_refused(tiny, tmp_path):
    settings = _settings(tiny, tmp_path)
    backed_up = dataclasses.replace(settings, colocate=dataclasses.replace(settings.colocate,
                                                                          disable_weights_backuper=False))
    with pytest.raises(loop_mod.TrainingError, match="disable_weights_backuper False asks for a separate host copy "
                                                     "of the trainer's weights; there is none here"):
        loop_mod.run(backed_up, in_process=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_worker_spec_carries_offload_train(tiny, tmp_path):
    assert loop_mod.worker_spec(_settings(tiny, tmp_path)).offload_train is True
    assert loop_mod.worker_spec(_settings(tiny, tmp_path, "--no-offload-train")).offload_train is False



def test_the_harness_reads_engine_readings_and_refuses_malformed_ones(tmp_path):
    from harness.readers import read_run

    lines = [
        {"time": 1.0, "event": "status", "rollout_id": None, "status": "started"},
        {"time": 2.0, "event": "memory", "rollout_id": 0, "engine": 0, "phase": "before_release", "sync": 1,
         "tags": ["weights"], "memory/physical_gb": 3.5, "memory/engine_weights_resident": True},
        {"time": 3.0, "event": "memory", "rollout_id": 0, "engine": 0, "rank": 0, "phase": "after_release",
         "sync": 1, "memory/physical_gb": 1.0},
        {"time": 4.0, "event": "memory", "rollout_id": 0, "engine": -1, "phase": "after_release", "sync": 1,
         "memory/physical_gb": 1.0},
        {"time": 5.0, "event": "memory", "rollout_id": 0, "rank": 0, "phase": "before_wake_up", "sync": 1,
         "memory/allocated_gb": 0.5, "memory/physical_gb": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = read_run(tmp_path, finished=False)
    assert [str(p) for p in run.problems] == [
        "metrics.jsonl:3: memory event with both 'rank' (a trainer rank's reading) and 'engine' (an engine's): give "
        "one; skipped",
        "metrics.jsonl:4: an engine's memory event needs a non-negative integer 'engine', got -1; skipped"]
