"""`watch` knows wall time (issue #24 item 6, #23 item 4): a run that writes nothing for a stated multiple of its
median cycle (a startup allowance before its first cycle) is failed, naming the phase it is stuck in, inferred
from its last event; `completes` reports the time since the last event by the clock; the report breaks each
cycle into phases. Every clock here is a fake one."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.criteria import Status, evaluate  # noqa: E402
from harness.monitor import Watcher  # noqa: E402
from harness.phases import current_phase, cycle_phases  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.stall import StallRule, find_stall  # noqa: E402
from harness.tier import SpecError, load_tier, parse_tier  # noqa: E402
from harness.verdict import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INPUT, EXIT_PASS  # noqa: E402

CONFIG = {**H.RECIPE_CONFIG, "eval_interval": 10, "num_rollout": 20}
S = H.HEALTHY.but(ranks=2, config=CONFIG, finished=False)


class FakeClock:
    """Wall and monotonic time in one, moved on only by the watch's own sleeps."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def cut_after(events: list[dict], test) -> list[dict]:
    """The events up to and including the first one ``test`` accepts."""
    return events[:next(i for i, e in enumerate(events) if test(e)) + 1]


def write(tmp_path: Path, events: list[dict], s: H.Scenario = S) -> Path:
    return H.write_run_dir(tmp_path / "run", s, lines=[json.dumps(e) for e in events])


def watch(path: Path, clock: FakeClock, rule: StallRule | None = None, kill: str | None = None, timeout: float = 1e6):
    return Watcher(path, load_tier("full").active(), kill_cmd=kill, poll_s=60.0, timeout_s=timeout, clock=clock,
                   sleep=clock.sleep, wall_clock=clock, stall=rule or load_tier("full").stall).run()


def test_a_run_silent_for_three_median_cycles_is_failed_naming_its_phase(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "train" and e["rollout_id"] == 5)
    path = write(tmp_path, events)
    clock = FakeClock(events[-1]["time"] + 60.0)
    stop = tmp_path / "STOP"
    outcome = watch(path, clock, kill=f"touch {stop}")
    assert outcome.exit_code == EXIT_FAIL and outcome.failed_at is None and not outcome.quiet_end
    stall = outcome.stall
    median = 726.0  # cycles 0–4: 720, 726, 732, 738, 720 s
    assert stall.limit_s == pytest.approx(3 * median)
    assert stall.limit_s < stall.silence_s <= stall.limit_s + 60.0  # caught at the first poll past the limit
    assert str(stall.phase) == "sync (after rollout 5)"
    assert stall.phase.where == f"metrics.jsonl:{len(events)}"
    assert str(stall).startswith(f"no new event for {stall.silence_s / 60:.1f} min (limit 36.3 min: 3 × the median "
                                 "cycle 12.10 min); last event metrics.jsonl:")
    assert stop.exists() and outcome.kill.returncode == 0


def test_before_the_first_cycle_the_startup_allowance_applies(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "memory" and e["sync"] == 0 and e["rank"] == 1
                       and e["phase"] == "after_update_weights")
    clock = FakeClock(events[-1]["time"])
    outcome = watch(write(tmp_path, events), clock)
    assert outcome.stall.limit_s == 90 * 60.0 and "the startup allowance 90 min" in outcome.stall.basis
    assert str(outcome.stall.phase) == "eval (before training)"


def test_after_a_resume_the_startup_allowance_applies_again(tmp_path):
    events = H.resumed_events(H.AT_SCALE.but(ranks=2, config=CONFIG, finished=False))
    resumed = next(i for i, e in enumerate(events) if e.get("status") == "resumed")
    events = events[:resumed + 1]
    outcome = watch(write(tmp_path, events, H.AT_SCALE.but(ranks=2, config=CONFIG)), FakeClock(events[-1]["time"]))
    assert outcome.stall.limit_s == 90 * 60.0 and "since the resume" in outcome.stall.basis
    assert str(outcome.stall.phase) == "startup (loading; the startup sync comes next)"


def test_a_run_that_keeps_writing_is_not_stalled_and_a_finished_one_never(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "rollout" and e["rollout_id"] == 3)
    path = write(tmp_path, events)
    clock = FakeClock(events[-1]["time"])
    outcome = watch(path, clock, timeout=30 * 60.0)  # 30 min of silence: under 3 × 12.1
    assert outcome.timed_out and outcome.stall is None and outcome.exit_code == EXIT_INCOMPLETE
    finished = H.write_run_dir(tmp_path / "done", H.HEALTHY.but(ranks=2))
    outcome = watch(finished, FakeClock(H.T0 + 10 * 86400.0))
    assert outcome.exit_code == EXIT_PASS and outcome.stall is None


def test_the_multiple_is_configurable_and_zero_turns_it_off(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "train" and e["rollout_id"] == 5)
    path = write(tmp_path, events)
    outcome = watch(path, FakeClock(events[-1]["time"]), rule=StallRule(6.0, 3600.0))
    assert outcome.stall.limit_s == pytest.approx(6 * 726.0)
    outcome = watch(path, FakeClock(events[-1]["time"]), rule=StallRule(0.0, 3600.0), timeout=86400.0)
    assert outcome.stall is None and outcome.timed_out


def test_a_writer_clock_ahead_of_ours_counts_from_when_the_watch_read_the_event(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "train" and e["rollout_id"] == 5)
    path = write(tmp_path, events)
    start = events[-1]["time"] - 3600.0  # our clock an hour behind the writer's
    outcome = watch(path, FakeClock(start))
    assert outcome.stall.silence_s == pytest.approx(outcome.stall.limit_s, abs=60.0)


def test_a_recipe_log_that_goes_quiet_is_judged_as_it_stands(tmp_path):
    """A stdout log never says its run ended: at the limit the watch judges it like check, no kill command."""
    log = H.write_recipe_log(tmp_path / "train.log", H.HEALTHY.but(ranks=4))
    stop = tmp_path / "STOP"
    clock = FakeClock(time.time())
    outcome = watch(log, clock, kill=f"touch {stop}")
    assert outcome.quiet_end and outcome.exit_code == EXIT_PASS and not stop.exists()
    assert str(outcome.stall.phase).startswith("generate")  # its last line is a sync's


def test_check_reports_the_time_since_the_last_event_by_the_clock(tmp_path):
    config = {"model_variant": "tiny", "expert_model_parallel_size": 1, "lora_base_cpu_backup": True,
              "colocate_memory_peak_device": "gpu"}
    s = H.HEALTHY.but(ranks=1, rollouts=4, config=config, cycle_seconds=lambda n: 20.0, startup_seconds=15.0,
                      eval_seconds=5.0, finished=False)
    path = H.write_run_dir(tmp_path / "run", s)
    last = H.events(s)[-1]["time"]
    run = read_run(path, now=last + 30 * 60.0)
    completes = next(c for c in load_tier("smoke").criteria if c.id == "completes")
    r = evaluate(completes, run)
    assert r.status is Status.PENDING
    assert r.summary == ("running for 1.67 min by its events, 4 rollouts; last event 30 min ago by the clock (yet)")
    assert r.evidence["minutes_since_last_event"] == pytest.approx(30.0)


# --- the phase now ----------------------------------------------------------------------------------------
def _phase_after(events: list[dict], test, tmp_path: Path, s: H.Scenario = S) -> str:
    return str(current_phase(read_run(write(tmp_path, cut_after(events, test), s))))


@pytest.mark.parametrize("test, phase", [
    (lambda e: e.get("status") == "started", "startup (loading; the startup sync comes next)"),
    (lambda e: e["event"] == "sync" and e["rollout_id"] is None, "eval (before training)"),
    (lambda e: e["event"] == "eval" and e["rollout_id"] == 0, "generate (rollout 1)"),
    (lambda e: e["event"] == "rollout" and e["rollout_id"] == 3, "train (rollout 3)"),
    (lambda e: e["event"] == "train" and e["rollout_id"] == 3, "sync (after rollout 3)"),
    (lambda e: e["event"] == "memory" and e["rollout_id"] == 3, "generate (rollout 4)"),  # its sync event is out
    (lambda e: e["event"] == "sync" and e["rollout_id"] == 9, "eval (after rollout 9)"),
    (lambda e: e["event"] == "eval" and e["rollout_id"] == 9, "generate (rollout 10)"),
    (lambda e: e["event"] == "sync" and e["rollout_id"] == 19, "eval (after rollout 19)"),
], ids=["started", "startup-sync", "eval-0", "rollout", "train", "memory-after-sync", "sync-eval-due", "eval",
        "last"])
def test_the_phase_is_inferred_from_the_last_event(tmp_path, test, phase):
    events = H.events(S.but(aime_solved={0: 11, 9: 14, 19: 15}))
    assert _phase_after(events, test, tmp_path) == phase


def test_the_phase_when_memory_comes_before_its_sync_event(tmp_path):
    """k3's own order: the ranks' readings, then the sync event."""
    events = cut_after(H.events(S), lambda e: e["event"] == "train" and e["rollout_id"] == 2)
    events.append({"time": events[-1]["time"] + 5, "event": "memory", "rollout_id": 2, "rank": 0,
                   "phase": "after_update_weights", "sync": 3, "memory/allocated_gb": 90.9})
    assert str(current_phase(read_run(write(tmp_path, events)))) == "sync (after rollout 2)"


def test_the_phase_after_a_resumed_startup_sync_and_at_the_end(tmp_path):
    events = H.resumed_events(H.AT_SCALE.but(ranks=2, config=CONFIG))
    startup = lambda e: e["event"] == "sync" and e["rollout_id"] is None and e["sync"] > 0  # noqa: E731
    assert _phase_after(events, startup, tmp_path / "a") == "generate (rollout 5)"  # no eval after a resume
    assert _phase_after(events, lambda e: e.get("status") == "finished", tmp_path / "b") == "ended (finished)"
    no_evals = S.but(config={**CONFIG, "eval_interval": 0})
    assert _phase_after(H.events(no_evals), lambda e: e["event"] == "sync" and e["rollout_id"] == 19, tmp_path / "c",
                        no_evals) == "finishing (the save after the last rollout)"


def test_the_phase_of_a_recipe_log(tmp_path):
    lines = H.recipe_log_lines(H.HEALTHY.but(ranks=2, rollouts=3))

    def phase_after(needle: str) -> str:
        k = max(i for i, x in enumerate(lines) if needle in x)
        return str(current_phase(read_run(H.write_recipe_log(tmp_path / f"{k}.log", lines=lines[:k + 1]))))

    assert phase_after("'perf/rollout_time'") == "train (rollout 2)"  # the rollout manager's perf line
    assert phase_after("'rollout/raw_reward'") == "train (rollout 2)"
    assert phase_after("'perf/step_time'") == "sync (after rollout 2)"
    assert phase_after("Memory-Usage") == "sync"
    assert phase_after("LoRA weight version") == "generate (rollout 3, or an eval after rollout 2)"


# --- phases per cycle, in the report ----------------------------------------------------------------------
def test_each_cycle_is_broken_into_phases(tmp_path):
    run = read_run(H.write_run_dir(tmp_path / "run", H.HEALTHY.but(ranks=2)))
    phases = cycle_phases(run)
    assert sorted(phases) == list(range(20))
    assert phases[0] == pytest.approx({"generate": 396.0, "train": 252.0, "sync": 21.5, "other": 50.5, "eval": 300.0})
    assert "eval" in phases[9] and "eval" not in phases[8]  # the eval after rollout 9 sits on cycle 9, not in it
    assert sum(v for k, v in phases[9].items() if k != "eval") == pytest.approx(H.HEALTHY.cycle_seconds(9))


def test_offload_and_onload_join_the_phases_when_logged(tmp_path):
    events = H.events(H.HEALTHY.but(ranks=1, rollouts=3))
    for e in events:
        if e["event"] == "train":
            e["perf/offload_time"] = 30.0
        if e["event"] == "sync" and e["rollout_id"] is not None:
            e["perf/onload_time"] = 20.0
    run = read_run(H.write_run_dir(tmp_path / "run", lines=[json.dumps(e) for e in events]))
    assert cycle_phases(run)[1] == pytest.approx({"generate": 399.3, "offload": 30.0, "train": 254.1, "onload": 20.0,
                                                  "sync": 21.5, "other": 1.1})


# --- the spec's [watch] and the flags ---------------------------------------------------------------------
def test_each_tier_states_its_stall_rule():
    assert {t: (load_tier(t).stall.multiple, load_tier(t).stall.startup_allowance_s / 60) for t in
            ("smoke", "gpu", "4layer", "full")} == {"smoke": (10.0, 3.0), "gpu": (10.0, 6.0), "4layer": (5.0, 30.0),
                                                    "full": (3.0, 90.0)}
    bare = parse_tier('[tier]\nname = "t"\n[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\n',
                      "t.toml")
    assert (bare.stall.multiple, bare.stall.startup_allowance_s) == (3.0, 3600.0)


@pytest.mark.parametrize("body, message", [
    ("[watch]\nstall_multiple = 0.5\n", "'stall_multiple' must be ≥ 1 (or 0: no stall detection), got 0.5"),
    ("[watch]\nstartup_allowance_minutes = 0\n", "'startup_allowance_minutes' must be positive"),
    ("[watch]\nstall_multiple = \"x\"\n", "'stall_multiple' must be a number"),
    ("[watch]\nstall = 3\n", "[watch]: unknown field(s) stall"),
])
def test_watch_table_errors(body, message):
    spec = '[tier]\nname = "t"\n' + body + '[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\n'
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        parse_tier(spec, "t.toml")


def test_watch_cli_fails_a_dead_run_at_once_and_takes_the_flags(tmp_path):
    """Dated three hours ago by the real clock: silent far beyond 3 × its 12-minute cycles."""
    shift = time.time() - 3 * 3600.0 - H.events(S)[-1]["time"]
    events = cut_after(H.events(S), lambda e: e["event"] == "rollout" and e["rollout_id"] == 7)
    for e in events:
        e["time"] += shift
    path = write(tmp_path, events)
    runner = CliRunner()
    result = runner.invoke(app, ["watch", str(path), "--poll", "0.01", "--timeout", "20"])
    assert result.exit_code == EXIT_FAIL, result.output
    flat = " ".join(result.output.split())
    assert "STALLED: no new event for" in flat and "stuck in train (rollout 7)" in flat
    result = runner.invoke(app, ["watch", str(path), "--poll", "0.01", "--timeout", "0.2", "--stall-multiple", "0"])
    assert result.exit_code == EXIT_INCOMPLETE and "timed out" in result.output
    result = runner.invoke(app, ["watch", str(path), "--stall-multiple", "0.5"])
    assert result.exit_code == EXIT_INPUT and "--stall-multiple must be ≥ 1" in result.output
    result = runner.invoke(app, ["watch", str(path), "--startup-allowance", "-1"])
    assert result.exit_code == EXIT_INPUT and "--startup-allowance must be a positive number" in result.output


def test_find_stall_needs_a_clock_reading_past_the_limit(tmp_path):
    events = cut_after(H.events(S), lambda e: e["event"] == "train" and e["rollout_id"] == 5)
    run = read_run(write(tmp_path, events))
    rule = load_tier("full").stall
    assert find_stall(run, rule, events[-1]["time"] + 3 * 726.0, None) is None
    assert find_stall(run, rule, events[-1]["time"] + 3 * 726.0 + 1, None) is not None
