"""Criteria and tier specs: every kind against hand-computed values, the built-in tiers, and the generated
scenarios (healthy, leaky, reward out of band, AIME flat, AIME noisy but passing by counts, cycle too slow,
missing metrics) with their expected verdicts and evidence."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.criteria import Status, Window, build_criterion, evaluate, least_squares_slope  # noqa: E402
from harness.cycles import cycle_times  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.run_data import ConfigEntry, EventTime, MemoryPoint, Point, RunData, StatusEntry, SyncPoint  # noqa: E402
from harness.tier import SpecError, builtin_tiers, load_tier, parse_tier  # noqa: E402
from harness.verdict import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS, exit_code, overall  # noqa: E402


def crit(kind: str, metric: str | list[str] = "m", window: object = "all", **params):
    table = {"id": "c", "kind": kind, "metric": metric, "doc": "a sentence", "window": window, **params}
    return build_criterion(table, "test.toml", {"gb300"})


def scalar_run(metric: str, values: dict[int, float], finished: bool = True, **extra: dict[int, float]) -> RunData:
    run = RunData()
    for i, v in values.items():
        seq = run.begin_event()
        run.add(Point(metric, i, v, seq, f"f:{seq + 1}"))
        for name, series in extra.items():
            if i in series:
                run.add(Point(name.replace("__", "/"), i, series[i], seq, f"f:{seq + 1}"))
    run.finished = finished
    return run


def memory_run(values: dict[int, list[float]], finished: bool = True, phase: str = "after_update_weights") -> RunData:
    """values: rank -> value per sync (0, 1, …)."""
    run = RunData()
    syncs = max(len(v) for v in values.values())
    for s in range(syncs):
        for rank, series in values.items():
            if s < len(series):
                seq = run.begin_event()
                run.add(MemoryPoint(rank, phase, s, "memory/allocated_gb", series[s], seq, f"f:{seq + 1}"))
    run.finished = finished
    return run


# --- tier specs -------------------------------------------------------------------------------------------
def test_builtin_tiers_load_and_full_encodes_the_recipe_numbers():
    assert builtin_tiers() == ["4layer", "full", "gpu", "smoke"]
    for name in builtin_tiers():
        assert load_tier(name).criteria
    full = {c.id: c for c in load_tier("full").criteria}
    assert (full["cycle_time"]["lo"], full["cycle_time"]["hi"], full["cycle_time"]["unit"]) == (11.0, 13.0, "min")
    assert full["cycle_time"].window == Window(1, None)
    assert full["memory_returns_to_baseline"]["tolerance_gb"] == 0.5
    assert full["memory_absolute_gb300"]["baseline_gb"] == 91.0 and full["memory_absolute_gb300"].profile == "gb300"
    assert (full["raw_reward_at_0"]["lo"], full["raw_reward_at_0"]["hi"]) == (0.5, 0.75)
    assert full["raw_reward_mean_0_9"].window == Window(0, 9) and full["raw_reward_mean_0_9"]["reduce"] == "mean"
    aime = full["aime_at_0"]
    assert (aime["lo"], aime["hi"], aime["n"], aime["lo_count"], aime["hi_count"]) == (0.37, 0.43, 30, 11, 13)
    rise = full["aime_rise_0_to_9"]
    assert (rise["min_rise"], rise["min_rise_count"], rise.window) == (0.06, 2, Window(0, 9))
    configs = {c.metric: c["value"] for c in full.values() if c.kind == "config_equals"}
    assert configs == {"expert_model_parallel_size": 8, "max_tokens_per_gpu": 8192,
                       "colocate_memory_peak_device": "gpu", "lora_base_cpu_backup": True}
    assert [c.id for c in load_tier("full").active()] == [c for c in full if c != "memory_absolute_gb300"]
    assert all(c.doc for c in full.values())


SPEC_HEAD = '[tier]\nname = "t"\n'


@pytest.mark.parametrize("body, message", [
    ('[[criterion]]\nid = "a"\nkind = "bend"\nmetric = "m"\ndoc = "d"\n', "criterion 'a': unknown kind 'bend'"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\nhigh = 2\n',
     "criterion 'a': unknown field(s) high for kind 'band'"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\nlo = 1\n', "criterion 'a': 'doc'"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = "x"\n', "'lo' must be a number"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 2\nhi = 1\n', "'lo' 2.0 is above 'hi'"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\nwindow = [3, 1]\n', "'window' must be"),
    ('[[criterion]]\nid = "a"\nkind = "rise_by"\nmetric = "m"\ndoc = "d"\n', "kind 'rise_by' needs 'min_rise'"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 0.37\nhi = 0.43\nn = 30\nlo_count = 12\n'
     'hi_count = 13\n', "'lo_count' = 12 disagrees with 'lo' = 0.37: 11/30 is the smallest count"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 0.37\nhi = 0.43\nn = 30\n',
     "state 'lo_count' = 11"),
    ('[[criterion]]\nid = "a"\nkind = "rise_by"\nmetric = "m"\ndoc = "d"\nmin_rise = 0.06\nn = 30\nmin_rise_count = 1\n'
     'window = [0, 9]\n', "'min_rise_count' must be 2"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\nprofile = "h100"\n',
     "profile 'h100' is not declared"),
    ('[[criterion]]\nid = "a"\nkind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\n[[criterion]]\nid = "a"\n'
     'kind = "band"\nmetric = "m"\ndoc = "d"\nlo = 1\n', "criterion id 'a' appears twice"),
    ('[[criterion]]\nid = "A b"\nkind = "band"\n', "'id' must be a lowercase identifier"),
    ("", "no [[criterion]] tables"),
    ("[[criterion]\n", "not valid TOML"),
])
def test_spec_errors_name_the_file_the_criterion_and_the_field(body, message):
    with pytest.raises(SpecError) as info:
        parse_tier(SPEC_HEAD + body, "my.toml")
    assert str(info.value).startswith("my.toml: ")
    assert message in str(info.value)


def test_unknown_tier_and_profile(tmp_path):
    with pytest.raises(SpecError, match="unknown tier 'fast'.*built in: 4layer, full, gpu, smoke"):
        load_tier("fast")
    with pytest.raises(SpecError, match="no such spec file"):
        load_tier(tmp_path / "x.toml")
    with pytest.raises(SpecError, match="no hardware profile 'h100'"):
        load_tier("full").active("h100")


# --- band -------------------------------------------------------------------------------------------------
def test_band_each_at_one_index():
    c = crit("band", window=[0, 0], lo=0.5, hi=0.75)
    assert evaluate(c, scalar_run("m", {0: 0.5, 1: 0.1})).status is Status.PASS  # inclusive bound; rollout 1 outside
    r = evaluate(c, scalar_run("m", {0: 0.49}))
    assert (r.status, r.final, r.evidence["failing_index"], r.where) == (Status.FAIL, True, 0, "f:1")
    assert evaluate(c, scalar_run("m", {0: float("nan")})).status is Status.FAIL
    assert evaluate(c, scalar_run("m", {1: 0.6}, finished=False)).status is Status.PENDING
    r = evaluate(c, scalar_run("m", {1: 0.6}, finished=True))
    assert (r.status, r.evidence["absent"]) == (Status.MISSING, [0])


def test_band_mean_over_a_window():
    c = crit("band", window=[0, 9], lo=0.5, hi=0.75, reduce="mean")
    values = {i: 0.3 if i == 0 else 0.62 for i in range(10)}  # one stray rollout, mean still inside
    r = evaluate(c, scalar_run("m", values))
    assert r.status is Status.PASS and r.evidence["mean"] == pytest.approx(statistics.fmean(values.values()))
    r = evaluate(c, scalar_run("m", {i: 0.45 for i in range(10)}))
    assert r.status is Status.FAIL and r.evidence["mean"] == pytest.approx(0.45)
    assert evaluate(c, scalar_run("m", {i: 0.6 for i in range(9)}, finished=False)).status is Status.PENDING


def test_band_on_solved_counts_keeps_the_pages_rounding():
    c = crit("band", window=[0, 0], lo=0.37, hi=0.43, n=30, lo_count=11, hi_count=13)
    for k, status in [(10, Status.FAIL), (11, Status.PASS), (12, Status.PASS), (13, Status.PASS), (14, Status.FAIL)]:
        assert evaluate(c, scalar_run("m", {0: k / 30})).status is status, k
    # 11/30 = 0.3667 is below 0.37 as a value, but it is the page's "0.37" as a count.
    r = evaluate(c, scalar_run("m", {0: 0.3667}))
    assert r.status is Status.PASS and r.evidence["counts"] == {0: 11}
    # Logged counts win over the value.
    r = evaluate(c, scalar_run("m", {0: 0.5}, m__n_correct={0: 12}, m__n={0: 30}))
    assert r.status is Status.PASS and r.evidence["counts"] == {0: 12}
    # A value that is no count of 30, or counts of another n: judged on the value, and said so.
    r = evaluate(c, scalar_run("m", {0: 0.38}))
    assert r.status is Status.PASS and "not a multiple of 1/30" in r.evidence["notes"][0]
    r = evaluate(c, scalar_run("m", {0: 0.45}, m__n_correct={0: 9}, m__n={0: 20}))
    assert r.status is Status.FAIL and "n = 20, not 30" in r.evidence["notes"][0]


# --- rise_by ----------------------------------------------------------------------------------------------
def test_rise_by_in_counts_and_values():
    c = crit("rise_by", window=[0, 9], min_rise=0.06, n=30, min_rise_count=2)
    r = evaluate(c, scalar_run("m", {0: 11 / 30, 9: 14 / 30}))  # the page's measured run: 0.367 -> 0.467
    assert (r.status, r.evidence["rise_count"]) == (Status.PASS, 3)
    assert evaluate(c, scalar_run("m", {0: 11 / 30, 9: 13 / 30})).status is Status.PASS  # +2 = 0.067
    r = evaluate(c, scalar_run("m", {0: 11 / 30, 9: 12 / 30}))
    assert (r.status, r.final, r.evidence["rise_count"]) == (Status.FAIL, True, 1)
    assert evaluate(c, scalar_run("m", {0: 0.4}, finished=False)).status is Status.PENDING
    assert evaluate(c, scalar_run("m", {0: 0.4})).status is Status.MISSING
    plain = crit("rise_by", window=[0, -1], min_rise=0.1)
    assert evaluate(plain, scalar_run("m", {0: 0.2, 4: 0.25, 9: 0.31})).status is Status.PASS  # first → last
    r = evaluate(plain, scalar_run("m", {0: 0.2, 4: 0.5, 9: 0.29}))
    assert (r.status, r.evidence["to"], r.evidence["rise"]) == (Status.FAIL, 9, pytest.approx(0.09))
    assert evaluate(plain, scalar_run("m", {0: 0.2, 9: 0.9}, finished=False)).status is Status.PENDING


# --- memory -----------------------------------------------------------------------------------------------
def test_returns_to_baseline_per_rank_and_sync():
    c = crit("returns_to_baseline", metric="memory/allocated_gb", tolerance_gb=0.5)
    ok = memory_run({0: [90.94, 91.40, 90.50], 1: [120.0, 120.2, 119.6]})  # per-rank baselines differ
    r = evaluate(c, ok)
    assert r.status is Status.PASS
    assert (r.evidence["worst_rank"], r.evidence["worst_sync"]) == (0, 1)
    assert r.evidence["worst_deviation_gb"] == pytest.approx(0.46)
    r = evaluate(c, memory_run({0: [90.94, 91.0, 91.0, 91.5], 1: [90.0, 90.6, 91.0, 92.0]}))
    assert r.status is Status.FAIL
    assert (r.evidence["first_failing_sync"], r.evidence["first_failing_rank"]) == (1, 1)
    assert r.evidence["deviation_gb"] == pytest.approx(0.6) and r.evidence["failing_ranks"] == [0, 1]  # 0 at sync 3
    below = memory_run({0: [90.0, 89.4]})
    assert evaluate(c, below).status is Status.FAIL
    assert evaluate(crit("returns_to_baseline", metric="memory/allocated_gb", tolerance_gb=0.5, side="above"),
                    below).status is Status.PASS
    absolute = crit("returns_to_baseline", metric="memory/allocated_gb", tolerance_gb=1.0, baseline_gb=91.0)
    r = evaluate(absolute, memory_run({0: [90.5, 90.9], 1: [92.5, 92.5]}))
    assert (r.status, r.evidence["first_failing_sync"], r.evidence["first_failing_rank"]) == (Status.FAIL, 0, 1)


def test_returns_to_baseline_pending_missing_and_gaps():
    c = crit("returns_to_baseline", metric="memory/allocated_gb", tolerance_gb=0.5)
    assert evaluate(c, memory_run({0: [90.0]}, finished=False)).status is Status.PENDING
    assert evaluate(c, memory_run({0: [90.0]})).status is Status.MISSING  # one sync proves nothing
    assert evaluate(c, memory_run({0: [90.0, 90.1]}, finished=False)).status is Status.PENDING  # open window
    r = evaluate(c, memory_run({0: [90.0, 90.1, 90.0], 1: [90.0]}))
    assert r.status is Status.MISSING and r.evidence["missing"] == {"1": [1, 2]}
    empty = RunData()
    empty.finished = True
    assert evaluate(c, empty).status is Status.MISSING


def test_least_squares_slope_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(range(12))
    ys = list(90 + 0.03 * np.arange(12) + rng.normal(0, 0.01, 12))
    assert least_squares_slope([float(x) for x in xs], ys) == pytest.approx(np.polyfit(xs, ys, 1)[0], rel=1e-10)
    with pytest.raises(ValueError):
        least_squares_slope([1.0, 1.0], [0.0, 1.0])


def test_no_growth_slope_per_rank():
    c = crit("no_growth", metric="memory/allocated_gb", max_slope_gb_per_sync=0.02, min_points=5)
    flat = [90.94, 90.95, 90.94, 90.93, 90.95, 90.94]
    creeping = [90.94 + 0.04 * s for s in range(6)]  # stays within 0.5 GB for 12 syncs, a leak all the same
    r = evaluate(c, memory_run({0: flat, 1: creeping}))
    assert (r.status, r.final, r.evidence["worst_rank"]) == (Status.FAIL, True, 1)
    assert r.evidence["worst_slope_gb_per_sync"] == pytest.approx(0.04)
    r = evaluate(c, memory_run({0: flat, 1: creeping}, finished=False))
    assert (r.status, r.final) == (Status.FAIL, False)  # a trend may flatten: the watch does not abort on it
    assert evaluate(c, memory_run({0: flat})).status is Status.PASS
    assert evaluate(c, memory_run({0: flat[:4]}, finished=False)).status is Status.PENDING


def test_memory_metric_alternatives_pick_what_the_run_logged():
    c = crit("returns_to_baseline", metric=["memory/allocated_gb", "memory/rss_gb"], tolerance_gb=0.1)
    run = RunData()
    for s, v in enumerate([1.20, 1.25, 1.41]):
        run.add(MemoryPoint(0, "after_update_weights", s, "memory/rss_gb", v, run.begin_event(), "f"))
    run.finished = True
    r = evaluate(c, run)
    assert (r.status, r.evidence["metric"], r.evidence["first_failing_sync"]) == (Status.FAIL, "memory/rss_gb", 2)


# --- config, completion, adapter versions -----------------------------------------------------------------
def test_config_equals_compares_megatron_text():
    run = RunData()
    seq = run.begin_event()
    for key, value in [("lora_base_cpu_backup", "True"), ("max_tokens_per_gpu", "8192"), ("device", "cpu")]:
        run.add(ConfigEntry(key, value, seq, "resolved_config.json"))
    assert evaluate(crit("config_equals", metric="lora_base_cpu_backup", value=True), run).status is Status.PASS
    assert evaluate(crit("config_equals", metric="max_tokens_per_gpu", value=8192), run).status is Status.PASS
    r = evaluate(crit("config_equals", metric="device", value="gpu"), run)
    assert (r.status, r.evidence["actual"], r.evidence["expected"]) == (Status.FAIL, "cpu", "gpu")
    assert evaluate(crit("config_equals", metric="absent", value=1), run).status is Status.PENDING
    run.finished = True
    assert evaluate(crit("config_equals", metric="absent", value=1), run).status is Status.MISSING


def _status_run(minutes: float, rollouts: int, end: str | None = "finished", error: str | None = None) -> RunData:
    run = RunData()
    run.add(StatusEntry("started", 1000.0, run.begin_event(), "m:1"))
    for i in range(rollouts):
        run.add(EventTime("rollout", i, 1000.0 + i, run.begin_event(), f"m:{i + 2}"))
    if end is not None:
        run.add(StatusEntry(end, 1000.0 + 60 * minutes, run.begin_event(), "m:end", error))
    return run


def test_completes_within():
    c = crit("completes_within", metric="status", max_minutes=5, min_rollouts=10)
    assert evaluate(c, _status_run(4.5, 10)).status is Status.PASS
    r = evaluate(c, _status_run(5.5, 10))
    assert r.status is Status.FAIL and r.evidence["minutes"] == pytest.approx(5.5)
    assert evaluate(c, _status_run(4.5, 9)).status is Status.FAIL
    r = evaluate(c, _status_run(1, 3, "failed", "CUDA out of memory"))
    assert r.status is Status.FAIL and "CUDA out of memory" in r.summary
    assert evaluate(c, _status_run(1, 3, None)).status is Status.PENDING


def test_adapter_version_advances_by_one():
    c = crit("advances", metric="adapter/version")

    def run_with(versions: list[int | None]) -> RunData:
        run = RunData()
        for i, v in enumerate(versions):
            run.add(SyncPoint(i, v, 4, None, run.begin_event(), f"log:{i + 1}"))
        run.finished = True
        return run

    assert evaluate(c, run_with([1, 2, 3, 4])).status is Status.PASS
    r = evaluate(c, run_with([1, 2, 2, 3]))
    assert (r.status, r.evidence["first_failing_sync"], r.where) == (Status.FAIL, 2, "log:3")
    assert evaluate(c, run_with([1, 3])).status is Status.FAIL
    assert evaluate(c, run_with([1, None])).status is Status.FAIL
    assert evaluate(c, run_with([1])).status is Status.MISSING


# --- cycle time -------------------------------------------------------------------------------------------
def test_cycle_time_from_each_source_of_truth(tmp_path):
    s = H.HEALTHY.but(ranks=1, rollouts=12)
    logged = read_run(H.write_run_dir(tmp_path / "a", s))
    derived = read_run(H.write_run_dir(tmp_path / "b", s.but(log_cycle_time=False)))
    from_log = read_run(H.write_recipe_log(tmp_path / "train.log", s))
    a, b, c = cycle_times(logged), cycle_times(derived), cycle_times(from_log)
    assert (a.rule, b.rule, c.rule) == ("perf/cycle_time", "event times", "perf/step_time")
    expected = {n: s.cycle_seconds(n) for n in range(1, 12)}
    assert {n: x.seconds for n, x in a.cycles.items() if n >= 1} == expected
    # Derived from event times: the eval after rollout 9 (300 s, logged) is taken out of cycle 10.
    assert {n: round(x.seconds, 3) for n, x in b.cycles.items() if n >= 1} == expected
    assert b.cycles[10].eval_seconds == H.EVAL_SECONDS
    # From the recipe's perf/step_time: no eval duration in the log, so cycle 10 is left out, not guessed.
    assert c.excluded == {0: "holds the eval before training, whose duration is not logged",
                          10: "holds the eval after rollout 9, whose duration is not logged"}
    assert {n: round(x.seconds, 6) for n, x in c.cycles.items() if n >= 1} == {
        n: v for n, v in expected.items() if n != 10}


def test_cycle_time_within_reports_median_and_worst(tmp_path):
    c = crit("cycle_time_within", metric="perf/cycle_time", window=[1, -1], lo=11, hi=13, unit="min")
    minutes = {0: 30.0, 1: 12.0, 2: 11.5, 3: 12.5, 4: 12.9}
    run = scalar_run("perf/cycle_time", {i: 60 * m for i, m in minutes.items()})
    r = evaluate(c, run)
    assert r.status is Status.PASS  # cycle 0 (start-up) is outside the window
    assert (r.evidence["median"], r.evidence["worst"], r.evidence["worst_cycle"]) == (12.25, 12.9, 4)
    slow = scalar_run("perf/cycle_time", {i: 60 * m for i, m in (minutes | {3: 13.5}).items()})
    r = evaluate(c, slow)
    assert (r.status, r.evidence["first_failing_cycle"], r.evidence["outside"]) == (Status.FAIL, 3, [3])
    lenient = crit("cycle_time_within", metric="perf/cycle_time", window=[1, -1], lo=11, hi=13, allowed_outside=1)
    assert evaluate(lenient, slow).status is Status.PASS
    assert evaluate(c, scalar_run("perf/cycle_time", {1: 720.0}, finished=False)).status is Status.PENDING


def test_a_profiled_cycle_is_left_out_and_named():
    """``k3 train --profile-train-step``: the profiler's cost is in that cycle's time, so it is not judged."""
    c = crit("cycle_time_within", metric="perf/cycle_time", window=[1, -1], lo=10, hi=17, unit="s")
    seconds = {0: 60.0, 1: 12.0, 2: 31.0, 3: 13.0}
    run = scalar_run("perf/cycle_time", seconds, perf__profiled_step={2: 1.0})
    r = evaluate(c, run)
    assert r.status is Status.PASS, r.summary
    assert r.evidence["excluded"] == {2: "its optimizer step 1 was profiled"}
    assert r.summary.endswith("; left out: cycle 2 its optimizer step 1 was profiled")
    assert evaluate(c, scalar_run("perf/cycle_time", seconds)).status is Status.FAIL  # unmarked, it counts


# --- scenarios --------------------------------------------------------------------------------------------
def judge(tmp_path: Path, s: H.Scenario, tier: str = "full", profile: str | None = "gb300", log: bool = False):
    path = H.write_recipe_log(tmp_path / "train.log", s) if log else H.write_run_dir(tmp_path / "run", s)
    run = read_run(path)
    results = {r.id: r for r in (evaluate(c, run) for c in load_tier(tier).active(profile))}
    return run, results


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_healthy_run_passes_everything(tmp_path, log):
    run, results = judge(tmp_path, H.HEALTHY, log=log)
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
    assert exit_code(list(results.values())) == EXIT_PASS
    assert results["aime_rise_0_to_9"].evidence["rise_count"] == 3
    assert results["cycle_time"].evidence["median"] == pytest.approx(12.15 if log else 12.2)


@pytest.mark.parametrize("log", [False, True], ids=["run_dir", "recipe_log"])
def test_leaky_rank_17_from_sync_3(tmp_path, log):
    _, results = judge(tmp_path, H.leaky(rank=17, from_sync=3, gb_per_sync=1.0), log=log)
    r = results["memory_returns_to_baseline"]
    assert (r.status, r.final) == (Status.FAIL, True)
    assert (r.evidence["first_failing_sync"], r.evidence["first_failing_rank"]) == (3, 17)
    assert r.evidence["failing_ranks"] == [17] and r.evidence["ranks"] == 64
    assert r.evidence["deviation_gb"] == pytest.approx(1.0)
    assert "rank 17 after sync 3" in r.summary
    assert results["memory_no_growth"].status is Status.FAIL
    assert results["memory_no_growth"].evidence["growing_ranks"] == [17]
    assert results["raw_reward_at_0"].status is Status.PASS
    assert exit_code(list(results.values())) == EXIT_FAIL


def test_small_leak_caught_by_the_slope_only(tmp_path):
    _, results = judge(tmp_path, H.leaky(rank=5, from_sync=2, gb_per_sync=0.03))
    assert results["memory_returns_to_baseline"].status is Status.FAIL  # 19 × 0.03 > 0.5 by the end…
    assert results["memory_returns_to_baseline"].evidence["first_failing_sync"] == 18  # …but only at sync 18
    assert results["memory_no_growth"].evidence["worst_rank"] == 5


def test_reward_out_of_band_at_rollout_0(tmp_path):
    _, results = judge(tmp_path, H.HEALTHY.but(reward=lambda n: 0.3 if n == 0 else 0.62))
    r = results["raw_reward_at_0"]
    assert (r.status, r.evidence["failing_index"], r.evidence["value"]) == (Status.FAIL, 0, 0.3)
    assert results["raw_reward_mean_0_9"].status is Status.PASS  # (0.3 + 9 × 0.62) / 10 = 0.588


def test_aime_flat(tmp_path):
    _, results = judge(tmp_path, H.HEALTHY.but(aime_solved={0: 11, 9: 11, 19: 12}))
    r = results["aime_rise_0_to_9"]
    assert (r.status, r.evidence["rise_count"], r.evidence["rise"]) == (Status.FAIL, 0, 0.0)
    assert results["aime_at_0"].status is Status.PASS


def test_aime_noisy_but_passing_by_counts(tmp_path):
    """The logged values carry noise and 4-decimal rounding (0.3667, 0.4333): as raw values eval@0 is below
    0.37 and the rise is 0.0666; as counts of 30 they are 11 and 13, both healthy."""
    noise = {0: -0.00003, 9: 0.00004, 19: 0.0}
    s = H.HEALTHY.but(aime_solved={0: 11, 9: 13, 19: 12}, log_counts=False,
                      aime_value=lambda i, k: round(k / 30 + noise[i], 4))
    run, results = judge(tmp_path, s)
    assert run.series("eval/aime")[0].value == 0.3666 and run.series("eval/aime")[0].value < 0.37
    r0, rise = results["aime_at_0"], results["aime_rise_0_to_9"]
    assert (r0.status, r0.evidence["counts"]) == (Status.PASS, {0: 11})
    assert (rise.status, rise.evidence["from_count"], rise.evidence["to_count"]) == (Status.PASS, 11, 13)
    assert "11/30" in rise.summary and "13/30" in rise.summary and "+0.06" in rise.summary


def test_cycle_too_slow(tmp_path):
    s = H.HEALTHY.but(cycle_seconds=lambda n: 14.5 * 60 if n == 6 else 720.0)
    for log_cycle_time in (True, False):
        _, results = judge(tmp_path / str(log_cycle_time), s.but(log_cycle_time=log_cycle_time))
        r = results["cycle_time"]
        assert (r.status, r.evidence["first_failing_cycle"]) == (Status.FAIL, 6)
        assert (r.evidence["worst"], r.evidence["worst_cycle"]) == (pytest.approx(14.5), 6)
        assert r.evidence["median"] == pytest.approx(12.0)


def test_missing_metrics_never_pass(tmp_path):
    s = H.HEALTHY.but(with_memory=False, with_eval=False, config={})
    run, results = judge(tmp_path, s)
    missing = {k for k, r in results.items() if r.status is Status.MISSING}
    assert missing == {"memory_returns_to_baseline", "memory_no_growth", "memory_absolute_gb300", "aime_at_0",
                       "aime_rise_0_to_9", "config_expert_model_parallel_size", "config_max_tokens_per_gpu",
                       "config_colocate_memory_peak_device", "config_lora_base_cpu_backup"}
    assert overall(list(results.values())) is Status.MISSING
    assert exit_code(list(results.values())) == EXIT_INCOMPLETE


def test_a_running_run_is_pending_not_missing(tmp_path):
    _, results = judge(tmp_path, H.HEALTHY.but(rollouts=5, finished=False))
    assert results["raw_reward_at_0"].status is Status.PASS  # decided at rollout 0
    assert results["memory_returns_to_baseline"].status is Status.PENDING  # every sync: not over yet
    assert results["raw_reward_mean_0_9"].status is Status.PENDING
    assert results["aime_rise_0_to_9"].status is Status.PENDING
    assert overall(list(results.values())) is Status.PENDING


def test_smoke_and_4layer_tiers_on_matching_runs(tmp_path):
    smoke_config = {"expert_model_parallel_size": 1, "lora_base_cpu_backup": True, "colocate_memory_peak_device": "gpu"}
    s = H.HEALTHY.but(ranks=1, rollouts=10, cycle_seconds=lambda n: 20.0, config=smoke_config,
                      aime_solved={0: 3, 9: 9}, startup_seconds=15.0, eval_seconds=5.0)
    _, results = judge(tmp_path / "smoke", s, tier="smoke", profile=None)
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
    assert results["eval_rises"].evidence["metric"] == "eval/aime"
    layer_config = {"expert_model_parallel_size": 8, "max_tokens_per_gpu": 512, "lora_base_cpu_backup": True,
                    "colocate_memory_peak_device": "gpu"}
    s4 = H.HEALTHY.but(ranks=8, rollouts=10, cycle_seconds=lambda n: 60.0, config=layer_config,
                       reward=lambda n: 0.5 + 0.05 * (-1) ** n)
    _, results = judge(tmp_path / "4layer", s4, tier="4layer", profile=None)
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
