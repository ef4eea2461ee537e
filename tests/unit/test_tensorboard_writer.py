"""The TensorBoard event files `k3 train` writes beside metrics.jsonl: the harness's TensorBoard reader reads them
back with the same names, steps and values; a resumed attempt's rollouts replace the killed attempt's. And the
progress line: rollout N/total with an ETA."""

from __future__ import annotations

import json
import math

import pytest

from k3.rl.metrics import MetricsWriter
from k3.rl.progress import RolloutProgress, format_duration
from k3.rl.tensorboard_writer import TENSORBOARD_DIR

pytest.importorskip("tensorboard")


def _read_back(log_dir):
    from harness.readers.tensorboard import TensorBoardSource
    from harness.run_data import RunData

    run = RunData(source=str(log_dir), kind="tensorboard")
    TensorBoardSource(log_dir).read(run, final=True)
    return run


def _write_cycle(writer: MetricsWriter, rollout_id: int, reward: float) -> None:
    writer.write("rollout", rollout_id, **{"rollout/raw_reward": reward, "perf/rollout_time": 1.5 + rollout_id,
                                           "rollout/response_len/mean": 7.25, "adapter_version": rollout_id + 1})
    writer.write("train", rollout_id, **{"train/loss": 0.01 * (rollout_id + 1), "perf/train_time": 0.75,
                                         "train/grad_norm": float("nan")})
    writer.write("memory", rollout_id, rank=0, phase="after_update_weights", sync=rollout_id + 1,
                 **{"memory/rss_gb": 1.0})
    writer.write("sync", rollout_id, **{"sync": rollout_id + 1, "adapter/version": rollout_id + 2,
                                        "perf/update_weights_time": 0.125, "perf/cycle_time": 3.5})


def test_the_harness_reads_the_event_files_back_with_the_same_values(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write("status", None, status="started")
        writer.write("sync", None, **{"sync": 0, "adapter/version": 1, "perf/update_weights_time": 0.2})
        writer.write("eval", 0, **{"eval/arith": 0.25, "eval/arith/n_correct": 1, "eval/arith/n": 4,
                                   "perf/eval_time": 2.0})
        for rid, reward in enumerate([0.5, 0.625, 0.1]):
            _write_cycle(writer, rid, reward)
        writer.write("status", None, status="finished")
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = {(k, e["rollout_id"]): v for e in logged if e["event"] in ("rollout", "train", "eval", "sync")
                and e["rollout_id"] is not None for k, v in e.items() if "/" in k}
    run = _read_back(tmp_path / TENSORBOARD_DIR)
    got = {(metric, index): point.value for metric, points in run.scalars.items() for index, point in points.items()}
    assert set(got) == set(expected)  # same names, steps = rollout ids; no memory, status or structure keys
    for key, value in expected.items():
        if value is None:  # a NaN in metrics.jsonl (null) is a NaN in TensorBoard, reported as such
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard stores float32
    assert any("non-finite" in p.message and "train/grad_norm" in p.where for p in run.problems)


def test_a_resumed_attempt_replaces_the_rerun_rollouts(tmp_path):
    with MetricsWriter(tmp_path) as writer:  # the killed attempt: rollouts 0, 1, 2
        for rid in range(3):
            _write_cycle(writer, rid, 0.1 * (rid + 1))
    with MetricsWriter(tmp_path) as writer:  # resumed from the checkpoint of rollout 0
        writer.write("status", None, status="started")
        writer.write("status", None, status="resumed", checkpoint="adapters/rollout_000000", next_rollout=1)
        for rid in range(1, 4):
            _write_cycle(writer, rid, 0.9 - 0.1 * rid)
    series = _read_back(tmp_path / TENSORBOARD_DIR).series("rollout/raw_reward")
    assert {r: round(p.value, 6) for r, p in series.items()} == {0: 0.1, 1: 0.8, 2: 0.7, 3: 0.6}


def test_no_event_file_without_a_rollout_metric(tmp_path):
    with MetricsWriter(tmp_path) as writer:  # a start that failed before any work
        writer.write("status", None, status="started")
        writer.write("status", None, status="failed", error="RuntimeError: x")
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_without_tensorboard_nothing_is_written(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        _write_cycle(writer, 0, 0.5)
    assert not (tmp_path / TENSORBOARD_DIR).exists()


# --------------------------------------------------------------------------- progress
def test_progress_line_counts_from_one_and_estimates_from_this_attempts_pace():
    now = [100.0]
    progress = RolloutProgress(total=10, clock=lambda: now[0])
    progress.begin(4)  # a resumed attempt starting at rollout 4
    now[0] += 30.0
    assert progress.finished(4, "reward 0.500") == "rollout 5/10: reward 0.500 | 30.0 s/rollout, ETA 2m30s"
    progress.begin(5)
    now[0] += 10.0
    assert progress.finished(5) == "rollout 6/10 | 20.0 s/rollout, ETA 1m20s"
    for rid in range(6, 10):
        progress.begin(rid)
        now[0] += 20.0
        line = progress.finished(rid)
    assert line == "rollout 10/10 | 20.0 s/rollout, done"


def test_progress_refuses_bad_use():
    with pytest.raises(ValueError, match="total must be >= 1 rollout, got 0"):
        RolloutProgress(total=0)
    with pytest.raises(RuntimeError, match=r"finished\(\) before begin\(\)"):
        RolloutProgress(total=3).finished(0)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"),
                                           (7620, "2h07m"), (-3, "0s")])
def test_durations_read_in_two_units(seconds, text):
    assert format_duration(seconds) == text


def test_a_resumed_attempt_wins_when_its_file_number_has_more_digits(tmp_path):
    """torch names event files ``…<seconds>.<host>.<pid>.<n>``, ``n`` counting the process's writers: a plain name
    sort read the 10th file before the 9th, and the killed attempt's rerun rollouts won (a flaky failure under
    xdist, where a worker had made 9 writers before)."""
    from harness.readers.tensorboard import event_file_order

    board = tmp_path / TENSORBOARD_DIR
    with MetricsWriter(tmp_path) as writer:
        for rid in range(3):
            _write_cycle(writer, rid, 0.1 * (rid + 1))
    (first,) = board.rglob("events.out.tfevents.*")
    first.rename(first.with_name("events.out.tfevents.1796461529.host.a.b.77.9"))
    with MetricsWriter(tmp_path) as writer:
        writer.write("status", None, status="resumed", checkpoint="adapters/rollout_000000", next_rollout=1)
        for rid in range(1, 4):
            _write_cycle(writer, rid, 0.9 - 0.1 * rid)
    second = next(f for f in board.rglob("events.out.tfevents.*") if not f.name.endswith(".9"))
    second.rename(second.with_name("events.out.tfevents.1796461529.host.a.b.77.10"))
    names = sorted(f.name for f in board.rglob("events.out.tfevents.*"))
    assert names[0].endswith(".10")  # what a plain sort does
    assert [p.name[-2:] for p in sorted(board.rglob("events.out.tfevents.*"), key=event_file_order)] == [".9", "10"]
    series = _read_back(board).series("rollout/raw_reward")
    assert {r: round(p.value, 6) for r, p in series.items()} == {0: 0.1, 1: 0.8, 2: 0.7, 3: 0.6}
