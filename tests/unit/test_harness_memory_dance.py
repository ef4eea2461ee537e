"""The memory dance in the harness: the engine's and the trainer's memory readings (docs/RUN_DIRECTORY.md,
"memory"), the criteria that judge them (``resident_while_asleep``, ``released_while_training``) and the ``gpu``
tier that carries them (harness/spec/gpu.toml), on generated `make smoke-gpu` runs (tests/fixtures/dance_runs.py):
the healthy run passes every criterion; each planted fault fails its criterion, naming the rank or engine, the
phase and the sync.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import dance_runs as D  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.criteria import SpecError, Status, build_criterion, evaluate, evaluate_all  # noqa: E402
from harness.phases import current_phase  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.tier import builtin_tiers, load_tier  # noqa: E402

GPU = load_tier("gpu")


def judge(tmp_path, r: D.DanceRun = D.HEALTHY, name: str = "run") -> dict:
    run = read_run(D.write_run_dir(tmp_path / name, r))
    assert [str(p) for p in run.problems] == []
    return {res.id: res for res in evaluate_all(GPU.active(), run)}


def line_of(tmp_path, name: str, predicate) -> str:
    """``metrics.jsonl:N`` of the first event of run ``name`` that ``predicate`` accepts."""
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return f"metrics.jsonl:{next(i for i, line in enumerate(lines, 1) if predicate(json.loads(line)))}"


# ------------------------------------------------------------------------------------------------ reading
def test_engine_and_trainer_readings_are_read_as_the_contract_says(tmp_path):
    run = read_run(D.write_run_dir(tmp_path / "run"))
    assert run.problems == []
    releases = [p for p in run.engine_memory if p.phase == "after_release" and "weights" in p.tags]
    assert len(releases) == 20 and [p.rollout_id for p in releases] == list(range(20))
    first = releases[0]
    assert (first.engine, first.sync, first.tags, first.weights_resident) == (0, 1, ("weights",), False)
    # before the first optimizer step: no optimizer state yet
    assert first.values == {"memory/physical_gb": pytest.approx(D.OTHER + D.P + D.G + D.CACHE)}
    startup = [p for p in run.engine_memory if p.rollout_id is None]
    assert [(p.phase, p.sync, p.tags) for p in startup] == [("before_resume", 0, ("kv_cache", "cuda_graph")),
                                                            ("after_resume", 0, ("kv_cache", "cuda_graph"))]
    asleep = run.memory_series("after_offload", "memory/physical_gb")
    assert sorted(asleep[0]) == list(range(21))
    assert run.memory_series("after_wake_up", "memory/allocated_gb")[0][1].value == pytest.approx(D.P + D.G)
    # the trainer's readings of the dance do not disturb its sync readings
    assert sorted(run.memory_series("after_update_weights", "memory/allocated_gb")[0]) == list(range(21))


def _run_lines(tmp_path, extra: list[dict]) -> list[str]:
    base = D.events(D.HEALTHY.but(rollouts=2))
    lines = [json.dumps(e) for e in base[:1]] + [json.dumps(e) for e in extra] + [json.dumps(e) for e in base[1:]]
    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return [str(p) for p in read_run(path).problems]


def test_malformed_engine_readings_are_reported_with_their_line(tmp_path):
    t = D.T0 + 1
    problems = _run_lines(tmp_path, [
        {"time": t, "event": "memory", "rollout_id": None, "engine": 0, "rank": 0, "phase": "after_release"},
        {"time": t, "event": "memory", "rollout_id": None, "engine": -1, "phase": "after_release", "tags": []},
        {"time": t, "event": "memory", "rollout_id": None, "engine": 0, "phase": "after_release", "tags": "weights"},
        {"time": t, "event": "memory", "rollout_id": None, "engine": 0, "phase": "after_release", "tags": ["weights"],
         "memory/physical_gb": 1.0, "memory/engine_weights_resident": "no"},
        {"time": t, "event": "memory", "rollout_id": None, "engine": 0, "phase": "after_release", "tags": []},
    ])
    assert problems == [
        "metrics.jsonl:2: memory event with both 'rank' (a trainer rank's reading) and 'engine' (an engine's): give "
        "one; skipped",
        "metrics.jsonl:3: an engine's memory event needs a non-negative integer 'engine', got -1; skipped",
        "metrics.jsonl:4: an engine's memory event needs 'tags': a list of strings, got 'weights'; skipped",
        "metrics.jsonl:5: memory/engine_weights_resident must be true or false, got 'no'; read as not said",
        "metrics.jsonl:6: engine 0's memory event without any memory/* value",
    ]


# ------------------------------------------------------------------------------------------------ the tier
def test_gpu_is_a_built_in_tier_everywhere_tiers_are_listed():
    assert "gpu" in builtin_tiers()
    runner = CliRunner()
    for command in ("check", "watch", "report", "criteria"):
        help_text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "smoke | gpu | 4layer | full" in help_text, command


def test_a_healthy_smoke_gpu_run_passes_every_criterion(tmp_path):
    results = judge(tmp_path)
    assert {i: str(r.status) for i, r in results.items() if r.status is not Status.PASS} == {}
    assert "at most 0.14 GB on the device while asleep" in results["trainer_asleep"].summary
    assert "11.14–11.14 GB left the device" in results["engine_released_during_training"].summary


def test_the_cli_verdict_of_a_healthy_run_is_0(tmp_path):
    path = D.write_run_dir(tmp_path / "run")
    out = CliRunner().invoke(app, ["check", str(path), "--tier", "gpu"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output


def test_a_trainer_that_keeps_its_base_while_asleep_fails_naming_rank_phase_and_sync(tmp_path):
    r = D.HEALTHY.but(sleep_keeps_gb=lambda sync: D.P if sync == 5 else 0.0)
    res = judge(tmp_path, r)["trainer_asleep"]
    assert res.status is Status.FAIL and res.final
    assert res.summary == ("rank 0 at after_offload of sync 5: 11.30 GB still on the device while asleep > 1 GB "
                           "(reserved 11.60 GB before the sleep, 0.30 GB left the device)")
    assert res.where == line_of(tmp_path, "run", lambda e: e.get("phase") == "after_offload" and e.get("sync") == 5)
    assert (res.evidence["first_failing_rank"], res.evidence["first_failing_sync"], res.evidence["phase"]) == (
        0, 5, "after_offload")


def test_without_reserved_the_allocated_memory_is_what_was_held(tmp_path):
    results = judge(tmp_path, D.HEALTHY.but(log_reserved=False))
    assert results["trainer_asleep"].status is Status.PASS
    assert results["trainer_asleep"].evidence["held_metric"] == "memory/allocated_gb"
    res = judge(tmp_path, D.HEALTHY.but(log_reserved=False, sleep_keeps_gb=lambda s: 2.0 if s == 3 else 0.0),
                "keeps")["trainer_asleep"]
    # allocated leaves out the cache the sleep emptied (0.30 GB here), so it reads that much less than reserved
    assert res.status is Status.FAIL and res.summary == (
        "rank 0 at after_offload of sync 3: 1.84 GB still on the device while asleep > 1 GB (allocated 11.30 GB "
        "before the sleep, 9.46 GB left the device)")


def test_a_sleep_without_its_after_reading_is_missing(tmp_path):
    path = D.write_run_dir(tmp_path / "run")
    lines = (path / "metrics.jsonl").read_text().splitlines()
    lines = [line for line in lines if not (json.loads(line).get("phase") == "after_offload"
                                             and json.loads(line).get("sync") == 7)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    res = evaluate(next(c for c in GPU.criteria if c.id == "trainer_asleep"), read_run(path))
    assert res.status is Status.MISSING
    assert res.summary.startswith("rank 0 sync 7: no memory/physical_gb at after_offload; 1 sleep(s)")


@pytest.mark.parametrize("fault, summary, phase", [
    (dict(no_weights_release=frozenset({3})),
     "engine 0, rollout 3: no release of its weights before training (no after_release reading with tag 'weights' "
     "before the train event)", "after_release"),
    (dict(resume_before_train=frozenset({4})),
     "engine 0, rollout 4 (sync 5): before_resume of its weights before training ended: the engine held them while "
     "the trainer trained", "before_resume"),
    (dict(release_frees_nothing=frozenset({6})),
     "engine 0, rollout 6 (sync 7): the release of its weights freed 0 GB of the device < 8 GB: the weights stayed "
     "resident", "after_release"),
    (dict(says_resident=frozenset({7})),
     "engine 0, rollout 7 (sync 8): after_release says its weights are still resident", "after_release"),
])
def test_an_engine_that_keeps_its_weights_through_training_fails_naming_engine_phase_and_sync(tmp_path, fault,
                                                                                              summary, phase):
    res = judge(tmp_path, D.HEALTHY.but(**fault))["engine_released_during_training"]
    assert res.status is Status.FAIL and res.final
    assert res.summary == summary
    assert res.evidence["first_failing_engine"] == 0 and res.evidence["phase"] == phase


def test_a_trainer_leak_fails_the_baseline_and_an_engine_leak_the_device_trend(tmp_path):
    results = judge(tmp_path, D.HEALTHY.but(trainer_leak_gb=lambda s: 0.05 if s >= 4 else 0.0), "trainer")
    assert results["memory_returns_to_baseline"].status is Status.FAIL
    assert results["memory_returns_to_baseline"].summary.startswith("rank 0 after sync 10: ")
    assert results["memory_no_growth"].status is Status.FAIL
    results = judge(tmp_path, D.HEALTHY.but(engine_leak_gb=lambda s: 0.1), "engine")
    assert results["memory_returns_to_baseline"].status is Status.PASS  # the trainer's allocator sees nothing
    assert results["device_no_growth"].status is Status.FAIL
    assert results["device_no_growth"].summary.startswith("steepest: rank 0 +0.1000 GB/sync")


def test_a_run_without_the_dance_fails_both_dance_criteria(tmp_path):
    """SMOKE_GPU_NO_DANCE=1: no sleep, no release: the trainer's criterion has nothing to judge, the engine's
    fails at the first trained rollout."""
    r = D.HEALTHY.but(no_weights_release=frozenset(range(20)))
    lines = [json.dumps(e) for e in D.events(r) if e.get("phase") not in ("before_offload", "after_offload")]
    path = D.write_run_dir(tmp_path / "run", r)
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    results = {res.id: res for res in evaluate_all(GPU.active(), read_run(path))}
    assert results["trainer_asleep"].status is Status.MISSING
    assert results["engine_released_during_training"].status is Status.FAIL
    assert results["engine_released_during_training"].summary.startswith("engine 0, rollout 0: no release")


def test_a_running_run_is_pending_not_passed(tmp_path):
    results = judge(tmp_path, D.HEALTHY.but(finished=False, rollouts=8))
    assert results["trainer_asleep"].status is Status.PENDING
    assert results["engine_released_during_training"].status is Status.PENDING


# ------------------------------------------------------------------------------------------------ the recipe log
def test_the_recipe_log_s_sleep_readings_are_judged_the_same_way(tmp_path):
    crit = next(c for c in GPU.criteria if c.id == "trainer_asleep")
    path = tmp_path / "train.log"
    path.write_text("\n".join(D.recipe_log_lines()) + "\n")
    run = read_run(path)
    assert run.problems == []
    assert sorted(run.memory_series("before_offload", "memory/physical_gb")[0]) == list(range(21))
    res = evaluate(crit, run)
    assert res.status is Status.PASS and res.evidence["physical_metric"] == "memory/physical_gb"
    path.write_text("\n".join(D.recipe_log_lines(D.HEALTHY.but(sleep_keeps_gb=lambda s: 5.0 if s == 9 else 0.0)))
                    + "\n")
    res = evaluate(crit, read_run(path))
    assert res.status is Status.FAIL
    assert res.summary.startswith("rank 0 at after_offload of sync 9: 5.14 GB still on the device while asleep")
    assert res.where.startswith("train.log:")


# ------------------------------------------------------------------------------------------------ spec and phases
@pytest.mark.parametrize("table, message", [
    ({"kind": "resident_while_asleep"}, "kind 'resident_while_asleep' needs 'max_gb'"),
    ({"kind": "resident_while_asleep", "max_gb": -1.0}, "'max_gb' must not be negative"),
    ({"kind": "released_while_training", "min_released_gb": -2.0}, "'min_released_gb' must not be negative"),
    ({"kind": "released_while_training", "tags": ["weights"]}, "unknown field(s) tags"),
])
def test_spec_mistakes_name_the_field(table, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_criterion({"id": "x", "metric": "memory/physical_gb", "doc": "d", **table}, "t.toml", set())


def test_the_phase_now_follows_the_dance(tmp_path):
    run = read_run(D.write_run_dir(tmp_path / "run"))

    def phase_after(predicate) -> str:
        seq = next(r.seq for r in run.records if predicate(r))
        return str(current_phase(run.until(seq)))

    assert phase_after(lambda r: getattr(r, "phase", None) == "after_release" and getattr(r, "rollout_id", None) == 2
                       ) == "offload (rollout 2)"
    assert phase_after(lambda r: getattr(r, "phase", None) == "after_wake_up" and r.sync == 3) == "offload (rollout 2)"
    assert phase_after(lambda r: getattr(r, "phase", None) == "after_offload" and r.sync == 3) == "onload (rollout 2)"
    assert phase_after(lambda r: getattr(r, "phase", None) == "after_resume" and r.sync == 0) == "onload (startup)"
