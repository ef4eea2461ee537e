"""The live watch: a background writer appends a run event by event; the watch must stop within one event
of the first hard FAIL, run the kill command (without a shell) and name the failing event."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.criteria import Status, evaluate_all  # noqa: E402
from harness.monitor import Watcher, first_failing_event, run_kill_command  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.tier import load_tier  # noqa: E402
from harness.verdict import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS  # noqa: E402

SMALL = dict(ranks=4, rollouts=8, with_eval=False)


class Writer(threading.Thread):
    """Appends lines to a file one at a time; stops as soon as ``stop_file`` exists (the kill command)."""

    def __init__(self, path: Path, lines: list[str], stop_file: Path, delay_s: float, preload: int = 0) -> None:
        super().__init__(daemon=True)
        self.path, self.lines, self.stop_file, self.delay_s = path, lines, stop_file, delay_s
        self.written = 0
        if preload:
            with open(path, "a") as f:
                f.write("".join(line + "\n" for line in lines[:preload]))
            self.written = preload

    def run(self) -> None:
        while self.written < len(self.lines) and not self.stop_file.exists():
            with open(self.path, "a") as f:
                f.write(self.lines[self.written] + "\n")
            self.written += 1
            time.sleep(self.delay_s)


def _criteria(tier: str = "full") -> list:
    return load_tier(tier).active()


def test_watch_stops_within_one_event_of_the_first_failure(tmp_path):
    s = H.leaky(rank=2, from_sync=3).but(**SMALL)
    lines = [json.dumps(e) for e in H.events(s)]
    failing_line = next(i for i, e in enumerate(H.events(s))
                        if e["event"] == "memory" and e["rank"] == 2 and e["sync"] == 3
                        and e["phase"] == "after_update_weights") + 1  # 1-based line in metrics.jsonl
    run_dir = tmp_path / "run"
    H.write_run_dir(run_dir, s, lines=[])
    stop = tmp_path / "STOP"
    writer = Writer(run_dir / "metrics.jsonl", lines, stop, delay_s=0.08, preload=failing_line - 4)
    watcher = Watcher(run_dir, _criteria(), kill_cmd=f"touch {stop}", poll_s=0.01, timeout_s=30)
    writer.start()
    outcome = watcher.run()
    writer.join(timeout=5)
    assert outcome.exit_code == EXIT_FAIL
    assert outcome.failed_where == f"metrics.jsonl:{failing_line}"
    assert [r.id for r in outcome.failures] == ["memory_returns_to_baseline"]
    evidence = outcome.failures[0].evidence
    assert (evidence["first_failing_sync"], evidence["first_failing_rank"]) == (3, 2)
    assert outcome.kill is not None and outcome.kill.returncode == 0 and stop.exists()
    # Stopped within one event: the writer got at most one more line out after the failing one.
    assert failing_line <= writer.written <= failing_line + 1
    assert not writer.is_alive()
    at_failure = {r.id: r.status for r in outcome.results}
    assert at_failure["memory_returns_to_baseline"] is Status.FAIL and at_failure["raw_reward_at_0"] is Status.PASS


def test_watch_a_recipe_log_being_written(tmp_path):
    s = H.HEALTHY.but(**SMALL, reward=lambda n: 0.2)  # out of band from rollout 0
    lines = H.recipe_log_lines(s)
    failing_line = next(i for i, x in enumerate(lines) if x.split(") ", 1)[-1].startswith("rollout 0:")) + 1
    log = tmp_path / "train.log"
    log.write_text("")
    stop = tmp_path / "STOP"
    writer = Writer(log, lines, stop, delay_s=0.05, preload=failing_line - 3)
    writer.start()
    outcome = Watcher(log, _criteria(), kill_cmd=f"touch {stop}", poll_s=0.01, timeout_s=30).run()
    writer.join(timeout=5)
    assert outcome.failed_where == f"train.log:{failing_line}"
    assert [r.id for r in outcome.failures] == ["raw_reward_at_0"]
    assert failing_line <= writer.written <= failing_line + 1


def test_watch_a_healthy_run_to_the_end(tmp_path):
    config = {"expert_model_parallel_size": 8, "max_tokens_per_gpu": 512, "lora_base_cpu_backup": True,
              "colocate_memory_peak_device": "gpu"}
    s = H.HEALTHY.but(ranks=2, rollouts=10, with_eval=False, config=config, startup_seconds=60.0,
                      cycle_seconds=lambda n: 90.0)
    lines = [json.dumps(e) for e in H.events(s)]
    run_dir = tmp_path / "run"
    H.write_run_dir(run_dir, s, lines=[])
    writer = Writer(run_dir / "metrics.jsonl", lines, tmp_path / "never", delay_s=0.0005)
    updates: list[int] = []
    watcher = Watcher(run_dir, load_tier("4layer").active(), poll_s=0.01, timeout_s=30,
                      on_update=lambda results, run: updates.append(run.events))
    writer.start()
    outcome = watcher.run()
    writer.join()
    assert {r.id: str(r.status) for r in outcome.results if r.status is not Status.PASS} == {}
    assert outcome.exit_code == EXIT_PASS and outcome.failed_at is None and outcome.kill is None
    assert len(updates) >= 2 and updates == sorted(updates)  # judged again as events arrived


def test_watch_waits_for_the_run_and_times_out(tmp_path):
    waits: list[str] = []
    outcome = Watcher(tmp_path / "not-yet", _criteria(), poll_s=0.01, timeout_s=0.1, on_wait=waits.append).run()
    assert outcome.timed_out and outcome.exit_code == EXIT_INCOMPLETE
    assert waits == [f"{tmp_path / 'not-yet'} does not exist yet; waiting for the run to start"]
    assert {r.status for r in outcome.results} == {Status.PENDING}


def test_watch_does_not_abort_on_a_trend_while_running(tmp_path):
    s = H.HEALTHY.but(ranks=2, rollouts=8, with_eval=False, finished=False,
                      memory=lambda r, k: 90.0 + 0.05 * k)  # +0.05 GB/sync: a trend, inside 0.5 GB for 10 syncs
    run_dir = H.write_run_dir(tmp_path / "run", s)
    outcome = Watcher(run_dir, _criteria(), poll_s=0.01, timeout_s=0.2).run()
    statuses = {r.id: (r.status, r.final) for r in outcome.results}
    assert statuses["memory_no_growth"] == (Status.FAIL, False)
    assert outcome.timed_out and outcome.failed_at is None and outcome.exit_code == EXIT_FAIL


def test_first_failing_event_by_bisection(tmp_path):
    s = H.leaky(rank=1, from_sync=4).but(ranks=3, rollouts=6, with_eval=False)
    run = read_run(H.write_run_dir(tmp_path / "run", s))
    criteria = [c for c in _criteria() if c.id == "memory_returns_to_baseline"]
    seq, failures = first_failing_event(criteria, run, lo=0)
    assert run.where_of(seq) == failures[0].where
    line = int(failures[0].where.split(":")[1])
    event = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[line - 1])
    assert (event["rank"], event["sync"], event["phase"]) == (1, 4, "after_update_weights")
    assert not any(r.hard_fail for r in evaluate_all(criteria, run.until(seq - 1)))  # nothing before it failed


def test_kill_command_is_split_and_never_given_to_a_shell(tmp_path):
    target = tmp_path / "a;b"
    outcome = run_kill_command(f"touch '{target}'")
    assert outcome.returncode == 0 and target.exists()  # one file named "a;b": no shell split it at ";"
    assert not (tmp_path / "a").exists()
    missing = run_kill_command("no-such-command-k3 stop")
    assert missing.returncode is None and "could not start" in missing.output
    with pytest.raises(ValueError, match="empty"):
        Watcher(tmp_path, _criteria(), kill_cmd="  ")


def test_watch_of_a_healthy_finished_run_passes(tmp_path):
    run_dir = H.write_run_dir(tmp_path / "run", H.HEALTHY.but(ranks=2))
    outcome = Watcher(run_dir, _criteria(), poll_s=0.01, timeout_s=10).run()
    assert outcome.exit_code == EXIT_PASS and not outcome.timed_out
