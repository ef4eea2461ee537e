"""The RL loop end to end on a tiny random K3, in process (the Ray path is the smoke's): the run directory the
harness reads, a broken adapter sync that must fail the run, resume from the adapter checkpoint."""

import json
import subprocess
import sys

import pytest
import torch
from tiny_checkpoint import write_tiny_run_inputs

from k3.launch.train import main as train_main
from k3.rl.data.order import prompts_for_rollout
from k3.rl.resume import latest_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("loop"))


def _argv(root, run, *extra):
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "6", "--eval-interval", "2", "--lr", "1e-3", "--save-interval", "1",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run),
            *extra]


def _events(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def teardown_calls(monkeypatch):
    """Records the in-process trainer's close and the engines' shutdown (the Ray path kills actors instead)."""
    from k3.rl.trainer_worker import TrainerWorker
    from k3.rollout.embedded.worker import EngineWorker

    calls = []
    for cls, method in ((TrainerWorker, "close"), (EngineWorker, "shutdown")):
        original = getattr(cls, method)

        def recording(self, _original=original, _name=f"{cls.__name__}.{method}"):
            calls.append(_name)
            return _original(self)

        monkeypatch.setattr(cls, method, recording)
    return calls


def test_run_directory_has_what_the_harness_reads(setup, monkeypatch, teardown_calls):
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    run = setup / "run"
    assert train_main(_argv(setup, run)) == 0
    # the trainer is closed first (its producer, then megatron's process group), then the engine
    assert teardown_calls == ["TrainerWorker.close", "EngineWorker.shutdown"]
    ev = _events(run)
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "status" and ev[0]["status"] == "started" and ev[-1]["status"] == "finished"
    syncs = [e for e in ev if e["event"] == "sync"]
    assert [s["sync"] for s in syncs] == [0, 1, 2] and [s["adapter/version"] for s in syncs] == [1, 2, 3]
    assert syncs[0]["rollout_id"] is None and "perf/cycle_time" in syncs[1]
    mem = [e for e in ev if e["event"] == "memory" and e["phase"] == "after_update_weights"]
    assert [m["sync"] for m in mem] == [0, 1, 2] and all(m["rank"] == 0 for m in mem)
    assert all(m["memory/allocated_gb"] > 0 for m in mem)
    rollouts = [e for e in ev if e["event"] == "rollout"]
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    assert all(0 <= r["rollout/raw_reward"] <= 1 for r in rollouts)
    evals = [e for e in ev if e["event"] == "eval"]
    assert [e["rollout_id"] for e in evals] == [0, 1] and all(e["eval/arith/n"] == 8 for e in evals)
    train = [e for e in ev if e["event"] == "train"]
    assert len(train) == 2 and all(t["rollout/train_rollout_logprob_abs_diff"] < 1e-3 for t in train)
    text = (run / "resolved_config.txt").read_text()
    assert "expert_model_parallel_size" in text and "lora_base_cpu_backup" in text
    assert latest_checkpoint(run).name == "rollout_000001"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard beside metrics.jsonl


def test_resume_continues_with_the_next_rollout(setup, monkeypatch):
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    run = setup / "resume"
    assert train_main(_argv(setup, run)) == 0
    assert train_main(_argv(setup, run, "--resume", "--num-rollout", "3")) == 0
    ev = _events(run)
    resumed = [e for e in ev if e.get("status") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["next_rollout"] == 2
    assert [e["rollout_id"] for e in ev if e["event"] == "rollout"] == [0, 1, 2]
    assert latest_checkpoint(run).name == "rollout_000002"
    # A finished run extended with --resume: sync numbers and adapter versions go on from where it stopped (the
    # startup sync serves the version saved with rollout 1's checkpoint + 1), and the resumed status names it.
    assert resumed[0]["checkpoint"] == "adapters/rollout_000001"
    syncs = [e for e in ev if e["event"] == "sync"]
    assert [s["sync"] for s in syncs] == [0, 1, 2, 3, 4]
    assert [s["adapter/version"] for s in syncs] == [1, 2, 3, 4, 5]
    mem = [e["sync"] for e in ev if e["event"] == "memory" and e["phase"] == "after_update_weights"]
    assert mem == [0, 1, 2, 3, 4]


def test_broken_adapter_sync_fails_the_run_and_the_verdict(setup, monkeypatch, teardown_calls):
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    monkeypatch.setenv("K3_TEST_BREAK_ADAPTER_SYNC", "1")
    run = setup / "broken"
    assert train_main(_argv(setup, run)) == 1
    assert teardown_calls == ["TrainerWorker.close", "EngineWorker.shutdown"]  # a failed run is torn down too
    ev = _events(run)
    assert ev[-1]["status"] == "failed" and "engine serves adapter version 0, expected 1" in ev[-1]["error"]
    verdict = subprocess.run([sys.executable, "-m", "harness.cli", "check", str(run), "--tier", "smoke"],
                             capture_output=True, text=True, timeout=120)
    assert verdict.returncode != 0, verdict.stdout


def test_prompt_order_is_a_pure_function_of_rollout_id():
    full = [prompts_for_rollout(10, r, 4, seed=3, shuffle=True) for r in range(6)]
    assert full[4] == prompts_for_rollout(10, 4, 4, seed=3, shuffle=True)
    flat = [i for r in full for i in r]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # epochs
    assert prompts_for_rollout(10, 1, 4, seed=3, shuffle=False) == [4, 5, 6, 7]


def test_metrics_writer_forwards_numbers_to_wandb_and_refuses_bad_events(tmp_path):
    from k3.rl.metrics import MetricsWriter

    class FakeRun:
        def __init__(self):
            self.logged, self.finished = [], False

        def log(self, d):
            self.logged.append(d)

        def finish(self):
            self.finished = True

    run = FakeRun()
    w = MetricsWriter(tmp_path, wandb_run=run)
    w.write("rollout", 0, **{"rollout/raw_reward": 0.5, "perf/rollout_time": float("nan"), "phase": "x"})
    with pytest.raises(ValueError, match="event 'bogus'"):
        w.write("bogus", 0)
    w.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["rollout/raw_reward"] == 0.5 and line["perf/rollout_time"] is None  # NaN -> null
    assert run.logged[0]["rollout/raw_reward"] == 0.5 and run.finished


def test_the_leak_baseline_is_taken_after_the_first_sync_that_follows_training():
    """Sync 0 (startup) and sync 1 (after the first train step, where the optimizer allocates its state) are the
    warm-up; every later sync is checked against the end of sync 1."""
    import time
    from types import SimpleNamespace

    from k3.rl.trainer_worker import TrainerWorker

    class Gate:
        def __init__(self):
            self.calls = []

        def set_baseline(self):
            self.calls.append("baseline")

        def end_sync(self):
            self.calls.append("check")
            return ["CUDA allocated +2.00 MiB over baseline"] if len(self.calls) == 4 else []

    worker = TrainerWorker.__new__(TrainerWorker)
    worker.leak, worker.rank, worker._syncs = Gate(), 0, 0
    worker.spec = SimpleNamespace(device="cpu")
    worker._reading = lambda phase: {"phase": phase, "rank": 0}
    results = [worker._sync_result(v, 1, time.perf_counter(), {}, v, True) for v in (1, 2, 3, 4)]
    assert worker.leak.calls == ["baseline", "baseline", "check", "check"]
    assert [m["phase"] for m in results[0]["memory"][1:]] == ["after_update_weights", "after_update_weights_cleanup"]
    assert [r["leak_problems"] for r in results] == [[], [], [], ["CUDA allocated +2.00 MiB over baseline"]]


@pytest.mark.parametrize("have_triton, says", [
    (False, "--expert-lora-kernel triton needs Triton (on a CUDA machine: pip install triton); use "
            "--expert-lora-kernel torch"),
    (True, "--expert-lora-kernel triton: the Triton kernels run on a CUDA device and this run trains on cpu; use "
           "--expert-lora-kernel torch"),
])
def test_triton_expert_kernel_where_it_cannot_run_stops_before_anything_starts(setup, monkeypatch, capsys,
                                                                               have_triton, says):
    """It would fail only at the first training step, after the warm-up and the first rollout."""
    from k3.kernels import availability

    monkeypatch.setenv("K3_IN_PROCESS", "1")
    monkeypatch.setattr(availability, "triton_available", lambda: have_triton)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: False)
    run = setup / f"run-triton-{have_triton}"
    assert train_main(_argv(setup, run, "--expert-lora-kernel", "triton")) == 1
    assert f"k3 train: error: {says}" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists()


def test_transfer_buffer_run_syncs_every_version_through_the_one_buffer_and_equals_fresh_buckets(setup, monkeypatch):
    """--lora-transfer-buffer: every chunk of every version is exported straight into the one persistent buffer (no
    staging copy, no fresh bucket reaches the leak gate), the engine serves each new version, and the run equals
    the fresh-bucket run metric for metric: the engine sampled and scored with the same adapters. The fresh-bucket
    run exports each chunk into its bucket too (nothing is flattened in)."""
    from k3.transport import handoff
    from k3.transport.leakcheck import LeakCheck

    monkeypatch.setenv("K3_IN_PROCESS", "1")
    calls = {"claim": 0, "stage": 0, "flatten_into": 0, "track": 0}
    buffers = []

    def counting(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in ((handoff.TransferBuffer, "claim"), (handoff.TransferBuffer, "stage"),
                        (handoff, "flatten_into"), (LeakCheck, "track")):
        counting(owner, name)
    real_init = handoff.TransferBuffer.__init__

    def init(self, *a, **k):
        buffers.append(self)
        real_init(self, *a, **k)

    assert train_main(_argv(setup, setup / "fresh-buckets")) == 0
    fresh_syncs = [e for e in _events(setup / "fresh-buckets") if e["event"] == "sync"]
    assert calls == {"claim": 0, "stage": 0, "flatten_into": 0, "track": sum(s["adapter/chunks"] for s in fresh_syncs)}

    calls.update(track=0)
    monkeypatch.setattr(handoff.TransferBuffer, "__init__", init)
    run = setup / "transfer-buffer"
    assert train_main(_argv(setup, run, "--lora-transfer-buffer")) == 0
    ev = _events(run)
    syncs = [e for e in ev if e["event"] == "sync"]
    assert [s["adapter/version"] for s in syncs] == [1, 2, 3] and ev[-1]["status"] == "finished"
    assert len(buffers) == 1 and buffers[0].dtype == torch.bfloat16 and buffers[0].device == torch.device("cpu")
    assert calls == {"claim": sum(s["adapter/chunks"] for s in syncs), "stage": 0, "flatten_into": 0, "track": 0}
    assert json.loads((run / "resolved_config.json").read_text())["lora_transfer_buffer"] is True

    def numbers(events, kind):
        return [{k: v for k, v in e.items() if k.startswith(("rollout/", "train/", "eval/"))}
                for e in events if e["event"] == kind]

    assert len(numbers(ev, "train")) == 2 and all("rollout/train_rollout_logprob_abs_diff" in t
                                                  for t in numbers(ev, "train"))
    for kind in ("rollout", "train", "eval"):
        assert numbers(ev, kind) == numbers(_events(setup / "fresh-buckets"), kind), kind
