"""The memory baseline at scale (issue #21 item 2): the startup sync runs before any optimizer step, so at the full
layout it sits ~3 GB (the Adam moments of a rank's LoRA factors) below every later sync. The baseline is each
rank's reading after the first sync that follows the first optimizer step; the startup sync is judged only for
"not above", on its own line. Both readers (run directory, recipe stdout log) and the absolute GB300 level."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.criteria import Status, evaluate_all  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.tier import load_tier  # noqa: E402


def judge(tmp_path: Path, s: H.Scenario, log: bool, profile: str | None = "gb300"):
    path = H.write_recipe_log(tmp_path / "train.log", s) if log else H.write_run_dir(tmp_path / "run", s)
    run = read_run(path)
    return run, {r.id: r for r in evaluate_all(load_tier("full").active(profile), run)}


def _base(rank: int) -> float:
    return 90.94 + 0.01 * (rank % 3)


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_the_startup_sync_is_read_as_one(tmp_path, log):
    run, _ = judge(tmp_path, H.AT_SCALE.but(ranks=4, rollouts=3), log)
    memory = run.memory_series("after_update_weights", "memory/allocated_gb")
    assert all(syncs[0].startup and not any(syncs[k].startup for k in (1, 2, 3)) for syncs in memory.values())


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_a_startup_sync_below_the_later_baseline_passes(tmp_path, log):
    _, results = judge(tmp_path, H.AT_SCALE, log)
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
    r = results["memory_returns_to_baseline"]
    assert r.evidence["syncs"] == 20 and r.evidence["startup_syncs"] == [0]
    assert r.evidence["startup_highest_deviation_gb"] == pytest.approx(-3.0)
    assert r.evidence["baseline_gb_min"] == pytest.approx(90.94)  # sync 1's level, not the startup's 87.94
    first, second = r.summary.splitlines()
    assert first.startswith("64 ranks × 20 syncs within ±0.5 GB of baseline")
    assert second == "startup sync 0: not above baseline + 0.5 GB (from -3.00 to -3.00 GB)"
    assert results["memory_no_growth"].status is Status.PASS  # the step from startup to sync 1 is no trend
    absolute = results["memory_absolute_gb300"]  # 87.94 at startup: only "not above 92" applies to it
    assert absolute.status is Status.PASS and "startup sync 0: not above 91 GB + 1 GB" in absolute.summary


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_a_small_leak_that_starts_late_on_one_rank_fails_naming_the_rank(tmp_path, log):
    def memory(rank: int, sync: int) -> float:
        return _base(rank) + (0.2 * (sync - 14) if rank == 42 and sync >= 15 else 0.0)

    _, results = judge(tmp_path, H.AT_SCALE.but(memory=memory), log)
    r = results["memory_returns_to_baseline"]
    assert (r.status, r.final) == (Status.FAIL, True)
    assert (r.evidence["first_failing_rank"], r.evidence["first_failing_sync"]) == (42, 17)  # +0.6 GB > 0.5
    assert r.evidence["failing_ranks"] == [42] and r.evidence["deviation_gb"] == pytest.approx(0.6)
    assert r.summary.startswith("rank 42 after sync 17: 91.54 GB vs baseline 90.94 GB (+0.60 GB")
    assert results["memory_no_growth"].evidence["growing_ranks"] == [42]


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_a_startup_sync_above_the_baseline_fails(tmp_path, log):
    # A startup sync above the level of every later one: it held something the later syncs did not.
    _, results = judge(tmp_path, H.HEALTHY.but(startup_offset_gb=-0.8), log)
    r = results["memory_returns_to_baseline"]
    assert r.status is Status.FAIL and r.evidence["first_failing_is_startup"]
    assert (r.evidence["first_failing_sync"], r.evidence["failing_ranks"]) == (0, list(range(64)))
    assert "rank 0 at startup sync 0: 91.74 GB is above baseline 90.94 GB (+0.80 GB" in r.summary
    # Below by any amount is fine: judged only for "not above".
    _, results = judge(tmp_path / "deep", H.HEALTHY.but(startup_offset_gb=30.0), log, profile=None)
    assert results["memory_returns_to_baseline"].status is Status.PASS


def test_the_absolute_gb300_level_with_its_tolerance(tmp_path):
    _, results = judge(tmp_path / "hi", H.AT_SCALE.but(memory=lambda r, s: 92.3), False)
    r = results["memory_absolute_gb300"]
    assert r.status is Status.FAIL and r.summary.startswith("rank 0 after sync 1: 92.3 GB vs 91 GB (+1.30 GB")
    assert results["memory_returns_to_baseline"].status is Status.PASS  # relative to itself it is flat
    # A startup sync above 92 GB fails the absolute level even though it is below every later sync's 91.
    _, results = judge(tmp_path / "startup", H.AT_SCALE.but(memory=lambda r, s: 95.5 if s == 0 else 91.0), False)
    r = results["memory_absolute_gb300"]
    assert (r.status, r.evidence["first_failing_sync"], r.evidence["first_failing_is_startup"]) == (
        Status.FAIL, 0, True)


def test_startup_readings_come_before_the_logs_first_rollout_line(tmp_path):
    """A recipe log cut so that it starts after the startup sync: its first sync follows training already."""
    lines = H.recipe_log_lines(H.AT_SCALE.but(ranks=2, rollouts=4))
    first_rollout = next(i for i, x in enumerate(lines) if " perf 0: " in x)
    startup = [i for i in range(first_rollout) if "Memory-Usage" in lines[i]]
    run = read_run(H.write_recipe_log(tmp_path / "train.log", lines=lines[:startup[0]] + lines[first_rollout:]))
    memory = run.memory_series("after_update_weights", "memory/allocated_gb")
    assert not any(p.startup for syncs in memory.values() for p in syncs.values())
    assert all(syncs[0].value == pytest.approx(_base(r)) for r, syncs in memory.items())
