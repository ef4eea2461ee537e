"""Evidence rules (issue #24 item 5): the harness never passes on lost or broken evidence. A NaN or infinite number a
criterion reads is MISSING or FAIL; a sync some rank has no memory reading for makes the memory criteria
MISSING; a corrupt resolved_config.json never changes the tier; input with nothing recognised exits 4."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.criteria import Status, build_criterion, evaluate, evaluate_all  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.run_data import MemoryPoint, Point, RunData  # noqa: E402
from harness.tier import load_tier  # noqa: E402
from harness.verdict import EXIT_INPUT, EXIT_PASS  # noqa: E402

runner = CliRunner()
SMOKE_CONFIG = {"model_variant": "tiny", "expert_model_parallel_size": 1, "lora_base_cpu_backup": True,
                "colocate_memory_peak_device": "gpu"}
SMOKE = H.HEALTHY.but(ranks=1, rollouts=10, cycle_seconds=lambda n: 20.0, config=SMOKE_CONFIG,
                      aime_solved={0: 3, 9: 9}, startup_seconds=15.0, eval_seconds=5.0)


def cli(*args: object, env: dict[str, str] | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def flat(text: str) -> str:
    """The output with its line wrapping undone."""
    return " ".join(text.split())


def smoke_results(path: Path) -> dict:
    run = read_run(path)
    return {r.id: r for r in evaluate_all(load_tier("smoke").active(), run)}


def crit(kind: str, **params: object):
    table = {"id": "c", "kind": kind, "metric": "m", "doc": "a sentence", **params}
    return build_criterion(table, "test.toml", set())


def _lines(s: H.Scenario = SMOKE) -> list[str]:
    return [json.dumps(e) for e in H.events(s)]


# --- non-finite numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_time_on_the_finished_line_is_not_a_pass(tmp_path, bad):
    lines = _lines()
    finished = json.loads(lines[-1])
    lines[-1] = lines[-1].replace(json.dumps(finished["time"]), bad)
    assert bad in lines[-1]
    path = H.write_run_dir(tmp_path / "run", SMOKE, lines=lines)
    results = smoke_results(path)
    r = results["completes"]
    assert r.status is Status.MISSING
    assert r.summary == f"the finished status (metrics.jsonl:{len(lines)}) has no valid time (run finished)"
    run = read_run(path)
    assert run.finished  # the status still counts: the run is over, its time is what is lost
    assert f"metrics.jsonl:{len(lines)}: 'time' is " in str(run.problems[0])
    assert "the event is kept without one" in str(run.problems[0])


def test_a_non_finite_start_time_is_not_a_pass(tmp_path):
    lines = _lines()
    lines[0] = lines[0].replace(json.dumps(H.T0), "NaN")
    r = smoke_results(H.write_run_dir(tmp_path / "run", SMOKE, lines=lines))["completes"]
    assert r.status is Status.MISSING and "the started status (metrics.jsonl:1) has no valid time" in r.summary


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_values_fail_every_kind(value):
    def scalar_run(values: dict[int, float], **extra: dict[int, float]) -> RunData:
        run = RunData()
        for i, v in values.items():
            seq = run.begin_event()
            run.add(Point("m", i, v, seq, f"f:{seq + 1}"))
            for name, series in extra.items():
                if i in series:
                    run.add(Point(name, i, series[i], seq, f"f:{seq + 1}"))
        run.finished = True
        return run

    assert evaluate(crit("band", window=[0, 0], lo=0.05), scalar_run({0: value})).status is Status.FAIL
    assert evaluate(crit("band", window=[0, 0], hi=0.95), scalar_run({0: value})).status is Status.FAIL
    assert evaluate(crit("band", window=[0, 1], lo=0.5, reduce="mean"), scalar_run({0: 0.6, 1: value})).status \
        is Status.FAIL
    assert evaluate(crit("rise_by", window=[0, 1], min_rise=0.1), scalar_run({0: 0.2, 1: value})).status \
        is Status.FAIL
    counts = crit("band", window=[0, 0], lo=0.37, hi=0.43, n=30, lo_count=11, hi_count=13)
    assert evaluate(counts, scalar_run({0: value})).status is Status.FAIL
    r = evaluate(counts, scalar_run({0: 0.4}, **{"m/n_correct": {0: value}, "m/n": {0: 30}}))
    assert r.status is Status.FAIL and r.summary.startswith(f"rollout@0: m/n_correct is {value}")  # not on 0.4
    r = evaluate(counts, scalar_run({0: 0.4}, **{"m/n_correct": {0: 12}, "m/n": {0: value}}))
    assert r.status is Status.FAIL and f"m/n is {value}" in r.summary
    rise = crit("rise_by", window=[0, 1], min_rise=0.06, n=30, min_rise_count=2)
    assert evaluate(rise, scalar_run({0: 0.4, 1: 0.5}, **{"m/n_correct": {0: 12, 1: value}})).status is Status.FAIL
    cycle = build_criterion({"id": "c", "kind": "cycle_time_within", "metric": "perf/cycle_time", "doc": "d",
                             "lo": 1, "hi": 2, "unit": "s"}, "t.toml", set())
    run = RunData()
    for i, v in enumerate([1.5, value, 1.5]):
        run.add(Point("perf/cycle_time", i, v, run.begin_event(), f"f:{i + 1}"))
    run.finished = True
    assert evaluate(cycle, run).status is Status.FAIL


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_memory_reading_fails(value):
    run = RunData()
    for s, v in enumerate([90.0, 90.1, value, 90.0, 90.1, 90.0]):
        run.add(MemoryPoint(0, "after_update_weights", s, "memory/allocated_gb", v, run.begin_event(), f"f:{s + 1}"))
    run.finished = True
    for kind, params in (("returns_to_baseline", {"tolerance_gb": 0.5}),
                         ("returns_to_baseline", {"tolerance_gb": 0.5, "side": "above"}),
                         ("returns_to_baseline", {"tolerance_gb": 1.0, "baseline_gb": 91.0}),
                         ("no_growth", {"max_slope_gb_per_sync": 0.02, "min_points": 5})):
        r = evaluate(crit(kind, metric="memory/allocated_gb", **params), run)
        assert (r.status, r.where) == (Status.FAIL, "f:3"), (kind, params, r.summary)
        assert "not a number" in r.summary


# --- a sync without a memory reading ----------------------------------------------------------------------
def test_a_corrupted_memory_line_in_the_middle_makes_the_memory_criteria_missing(tmp_path):
    lines = _lines()
    events = [json.loads(x) for x in lines]
    k = next(i for i, e in enumerate(events) if e["event"] == "memory" and e["phase"] == "after_update_weights"
             and e["sync"] == 5)
    lines[k] = lines[k][:40]  # a torn write
    results = smoke_results(H.write_run_dir(tmp_path / "run", SMOKE, lines=lines))
    assert results["adapter_version_advances"].status is Status.PASS  # 11 syncs were delivered …
    for cid in ("memory_returns_to_baseline", "memory_no_growth"):  # … so 10 readings prove nothing about sync 5
        r = results[cid]
        assert r.status is Status.MISSING, (cid, r.summary)
        assert r.summary.startswith("sync 5: no reading of rank 0; 1 sync(s) lack readings of 1 of 1 rank(s)")
        assert r.evidence["missing"] == {"0": [5]}


def test_a_lost_reading_of_one_rank_is_missing_for_that_sync(tmp_path):
    lines = _lines(H.HEALTHY)
    events = [json.loads(x) for x in lines]
    k = next(i for i, e in enumerate(events) if e["event"] == "memory" and e["phase"] == "after_update_weights"
             and e["sync"] == 7 and e["rank"] == 33)
    del lines[k]
    run = read_run(H.write_run_dir(tmp_path / "run", H.HEALTHY, lines=lines))
    r = evaluate([c for c in load_tier("full").criteria if c.id == "memory_returns_to_baseline"][0], run)
    assert r.status is Status.MISSING and r.summary.startswith("sync 7: no reading of rank 33;")


def test_a_garbled_memory_line_of_a_one_rank_recipe_log_is_missing(tmp_path):
    """The recipe log counts a rank's readings: a lost one leaves the rank short of the last sync."""
    s = H.HEALTHY.but(ranks=1, rollouts=8)
    lines = H.recipe_log_lines(s)
    k = [i for i, x in enumerate(lines) if "Memory-Usage" in x][4]
    lines[k] = lines[k][:lines[k].index("'allocated_GB'") + 5]
    run = read_run(H.write_recipe_log(tmp_path / "train.log", lines=lines))
    assert len(run.problems) == 1 and len(run.syncs) == 9
    r = evaluate([c for c in load_tier("full").criteria if c.id == "memory_returns_to_baseline"][0], run)
    assert r.status is Status.MISSING and r.summary.startswith("sync 8: no reading of rank 0;")


def test_a_killed_attempts_last_sync_is_excused_but_a_finished_runs_is_not(tmp_path):
    s = H.AT_SCALE.but(ranks=4, rollouts=12)
    events = H.resumed_events(s, kill="sync", at=6, checkpoint=4)  # half the ranks of sync 7 got out
    run = read_run(H.write_run_dir(tmp_path / "a", s, lines=[json.dumps(e) for e in events]))
    memory = [c for c in load_tier("full").criteria if c.id == "memory_returns_to_baseline"][0]
    assert evaluate(memory, run).status is Status.PASS
    cut = H.events(s)[:-3]  # a finished run whose last sync lost two ranks' readings
    cut.append({"time": cut[-1]["time"], "event": "status", "rollout_id": None, "status": "finished"})
    run = read_run(H.write_run_dir(tmp_path / "b", s, lines=[json.dumps(e) for e in cut]))
    assert evaluate(memory, run).status is Status.MISSING


# --- the resolved config ----------------------------------------------------------------------------------
def test_a_corrupt_resolved_config_json_falls_back_to_the_text_dump(tmp_path):
    path = H.write_run_dir(tmp_path / "run", SMOKE)
    (path / "resolved_config.txt").write_text(
        "------------------------ arguments ------------------------\n"
        + "".join(f"  {k} {'.' * (40 - len(k))} {v}\n" for k, v in SMOKE_CONFIG.items())
        + "-------------------- end of arguments ---------------------\n")
    (path / "resolved_config.json").write_text('{"model_variant": "tiny", "expert_mo')
    result = cli("check", path)
    assert result.exit_code == EXIT_PASS, result.output
    assert "tiny K3 on CPU" in result.output  # the smoke tier, as the run's variant says: never full
    assert "resolved_config.json: is not valid JSON" in flat(result.output)
    assert "the resolved config is read from resolved_config.txt instead" in flat(result.output)


def test_a_corrupt_resolved_config_json_alone_fails_clearly_without_a_tier(tmp_path):
    path = H.write_run_dir(tmp_path / "run", SMOKE)
    (path / "resolved_config.json").write_bytes(b"\x00\xff garbage")
    result = cli("check", path)
    assert result.exit_code == EXIT_INPUT
    assert "is not valid JSON" in result.output and "there is no resolved_config.txt" in result.output
    assert "the tier cannot be told from the run's model_variant; pass --tier" in flat(result.output)
    result = cli("check", path, "--tier", "smoke")  # told: judged, the config lines MISSING
    assert "verdict: MISSING" in result.output


def test_an_unknown_model_variant_does_not_choose_a_tier(tmp_path):
    path = H.write_run_dir(tmp_path / "run", SMOKE.but(config={**SMOKE_CONFIG, "model_variant": "huge"}))
    result = cli("check", path)
    assert result.exit_code == EXIT_INPUT and "model_variant 'huge' (resolved_config.json) has no tier" in result.output


# --- nothing recognised -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", bytes(range(256)) * 64, b"hello\nworld\n"],
                         ids=["empty", "binary", "text"])
def test_input_with_nothing_recognised_exits_4_with_one_line(tmp_path, content):
    path = tmp_path / "input.log"
    path.write_bytes(content)
    for command in ("check", "report"):
        result = cli(command, path)
        assert result.exit_code == EXIT_INPUT, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"k3-harness: error: {path}: nothing recognised in it")
        assert "expected the public recipe's stdout log" in lines[0] and "k3 run directory" in lines[0]


def test_a_run_directory_with_nothing_recognised_exits_4(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text("garbage\n{also not json\n")
    result = cli("check", path)
    assert result.exit_code == EXIT_INPUT
    assert "nothing recognised in it (2 line(s) could not be used); expected a k3 run directory" in result.output
