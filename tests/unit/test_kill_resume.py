"""``kill -9`` of a real ``k3 train`` at four points (during a rollout, a training step, an adapter sync, a
checkpoint save), then ``--resume`` into the same directory: the harness judges the resumed run healthy on all
of its syncs, and every rollout's metrics are there exactly once (the later attempt's for the rollouts run again).

The killed run is ``k3.launch.train.main`` in a subprocess (in-process trainer and engine, ``K3_IN_PROCESS=1``)
with one hook: at the chosen point it writes a marker file and waits; the test then sends it ``SIGKILL`` from
outside, so the kill lands exactly there and nothing of the process gets to clean up. The resume runs in this
process. One kill point runs in the default suite, the other three are ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import write_tiny_run_inputs

from k3.launch.train import main as train_main
from k3.rl.resume import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 7  # memory_no_growth needs >= 5 syncs after training in the run

# Waits at the chosen point (after writing the marker) until the test kills it. ``point`` and ``at``: rollout N
# (inside the engine's generate of rollout N), train N (inside its optimizer step), sync V (inside the engine's
# activation of adapter version V: the chunks are sent, the trainer waits for the ack), save N (the adapter
# files of rollout N's checkpoint written into the temp dir, its trainer state not yet).
_DRIVER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    point, at, marker, argv = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    from k3.launch.train import main
    from k3.rl.loop import Loop
    from k3.rl.trainer_worker import TrainerWorker
    from k3.rollout.embedded.engine import EmbeddedEngine
    from k3.rollout.embedded.worker import EngineWorker

    current = [None]

    def wait_for_the_kill():
        marker.write_text(str(os.getpid()))
        time.sleep(600)
        os._exit(3)  # never reached when the test kills us

    def wrap(cls, name, before=None, after=None):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if before is not None and before(*args):
                wait_for_the_kill()
            out = original(self, *args, **kwargs)
            if after is not None and after(*args):
                wait_for_the_kill()
            return out

        setattr(cls, name, wrapped)

    def note_rollout(rollout_id):
        current[0] = rollout_id
        return False

    wrap(Loop, "rollout_and_train", before=note_rollout)
    if point == "rollout":
        wrap(EngineWorker, "generate", before=lambda *a: current[0] == at)
    elif point == "train":
        wrap(TrainerWorker, "train_step", before=lambda *a: current[0] == at)
    elif point == "sync":
        wrap(EmbeddedEngine, "activate", before=lambda version, *a: version == at)
    elif point == "save":
        wrap(TrainerWorker, "save_adapter", after=lambda path, *a: f"rollout_{at:06d}" in str(path))
    sys.exit(main(argv))
""")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("kill"), n_train=32, n_eval=4)


def _argv(root: Path, run: Path) -> list[str]:
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", str(NUM_ROLLOUT),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "4", "--lr", "1e-3", "--save-interval", "1", "--eval-interval", "100",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run)]


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _kill_during(point: str, at: int, root: Path, run: Path) -> None:
    marker = run.parent / f"{run.name}.reached"
    env = {**os.environ, "K3_IN_PROCESS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, point, str(at), str(marker), *_argv(root, run)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 150
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"k3 train ended (exit {proc.returncode}) before reaching {point} {at}:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"k3 train never reached {point} {at}"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _judge(run: Path, tmp: Path) -> dict[str, dict]:
    out = tmp / "verdict.json"
    verdict = subprocess.run([sys.executable, "-m", "harness.cli", "check", str(run), "--tier", "smoke", "--json",
                              str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.is_file(), verdict.stdout + verdict.stderr
    return {r["id"]: r for r in json.loads(out.read_text())["results"]}


def _check_resumed_run(run: Path, tmp: Path, checkpoint: str, next_rollout: int) -> None:
    from harness.readers import read_run

    events = _events(run)
    assert events[-1]["status"] == "finished"
    resumed = [e for e in events if e.get("status") == "resumed"]
    assert len(resumed) == 1
    assert (resumed[0]["checkpoint"], resumed[0]["next_rollout"]) == (checkpoint, next_rollout)
    # Syncs continue: every sync of every attempt has its own index, and the resumed attempt's startup sync
    # serves the saved version + 1.
    at = events.index(resumed[0])
    syncs = [e for e in events if e["event"] == "sync"]
    assert [s["sync"] for s in syncs] == sorted({s["sync"] for s in syncs})
    first_resumed = next(e for e in events[at:] if e["event"] == "sync")
    before = [e["sync"] for e in events[:at] if "sync" in e]
    assert first_resumed["sync"] == max(before) + 1
    saved_version = torch.load(run / checkpoint / "trainer_state.pt", weights_only=True)["version"]
    assert first_resumed["adapter/version"] == saved_version + 1
    resumed_versions = [e["adapter/version"] for e in events[at:] if e["event"] == "sync"]
    assert resumed_versions == list(range(saved_version + 1, saved_version + 1 + len(resumed_versions)))
    assert latest_checkpoint(run).name == f"rollout_{NUM_ROLLOUT - 1:06d}"

    # The harness: healthy on every sync of both attempts.
    results = _judge(run, tmp)
    for criterion in ("adapter_version_advances", "memory_returns_to_baseline", "memory_no_growth"):
        assert results[criterion]["status"] == "PASS", results[criterion]
    # ... on all of them: every sync with readings is judged (the startup ones for "not above"), in both attempts.
    read = {e["sync"] for e in events if e["event"] == "memory" and e["phase"] == "after_update_weights"}
    assert read == {s["sync"] for s in syncs}
    memory = results["memory_returns_to_baseline"]["evidence"]
    assert memory["attempts"] == 2 and "unjudged" not in memory
    assert memory["syncs"] + len(memory["startup_syncs"]) == len(read)
    assert memory["startup_syncs"] == [syncs[0]["sync"], first_resumed["sync"]]
    # No rollout lost or counted twice: one value per rollout, the later attempt's for the rollouts run again.
    data = read_run(run)
    assert not [p for p in data.problems if "logged again" in p.message], data.problems
    for metric in ("rollout/raw_reward", "perf/train_time"):
        series = data.series(metric)
        assert sorted(series) == list(range(NUM_ROLLOUT)), metric
        assert all(series[r].attempt == 1 for r in range(next_rollout, NUM_ROLLOUT)), metric
    rerun = [r for r in range(next_rollout, NUM_ROLLOUT)]
    logged = [e["rollout_id"] for e in events[at:] if e["event"] == "rollout"]
    assert logged == rerun


def _kill_and_resume(point: str, at: int, inputs: Path, tmp_path: Path, checkpoint: str, next_rollout: int,
                     monkeypatch) -> None:
    run = tmp_path / f"run-{point}"
    _kill_during(point, at, inputs, run)
    assert latest_checkpoint(run).name == Path(checkpoint).name  # what the killed attempt left to resume from
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    assert train_main([*_argv(inputs, run), "--resume"]) == 0
    _check_resumed_run(run, tmp_path, checkpoint, next_rollout)


@pytest.mark.timeout(300)
def test_kill_9_during_training_then_resume_is_judged_healthy(inputs, tmp_path, monkeypatch):
    """Killed inside rollout 2's optimizer step: rollouts 0 and 1 are checkpointed, rollout 2 runs again."""
    _kill_and_resume("train", 2, inputs, tmp_path, "adapters/rollout_000001", 2, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_during_a_rollout_then_resume_is_judged_healthy(inputs, tmp_path, monkeypatch):
    _kill_and_resume("rollout", 2, inputs, tmp_path, "adapters/rollout_000001", 2, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_during_a_sync_then_resume_is_judged_healthy(inputs, tmp_path, monkeypatch):
    """Killed while the engine activates version 4 (the sync after rollout 2's training): the engine never
    acked it and no sync event or memory reading of it was written."""
    _kill_and_resume("sync", 4, inputs, tmp_path, "adapters/rollout_000001", 2, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_during_a_save_then_resume_is_judged_healthy(inputs, tmp_path, monkeypatch):
    """Killed with rollout 2's adapter files in the temp dir and its trainer state not yet written: rollout 2
    and its sync were logged, the checkpoint of rollout 1 is the one resumed, and rollout 2 runs again."""
    _kill_and_resume("save", 2, inputs, tmp_path, "adapters/rollout_000001", 2, monkeypatch)


def test_a_line_cut_by_a_kill_is_ended_before_the_next_attempt_writes(tmp_path):
    """A ``kill -9`` mid-write can leave the last line without its newline: the next attempt's first event must
    start a line of its own (the cut line is the harness's to report), and the sync count goes on past it."""
    from k3.rl.metrics import MetricsWriter
    from k3.rl.resume import next_sync_index

    (tmp_path / "metrics.jsonl").write_text('{"time": 1, "event": "sync", "rollout_id": null, "sync": 0}\n'
                                            '{"time": 2, "event": "memory", "sync": 1, "ph')
    assert next_sync_index(tmp_path) == 1
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write("status", None, status="started")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1].endswith('"ph') and json.loads(lines[2])["status"] == "started"
    assert next_sync_index(tmp_path / "nothing-here") == 0
