"""`k3-harness check | watch | report | criteria` and the pytest plugin, on generated runs: verdict, evidence
and exit code of each."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.cli import app  # noqa: E402
from harness.verdict import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INPUT, EXIT_PASS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_check_healthy_leaky_missing(tmp_path):
    healthy = H.write_run_dir(tmp_path / "healthy")
    result = cli("check", healthy, "--tier", "full", "--profile", "gb300")
    assert result.exit_code == EXIT_PASS, result.output
    assert "verdict: PASS" in result.output and "12 PASS" in result.output

    leaky = H.write_run_dir(tmp_path / "leaky", H.leaky())
    result = cli("check", leaky, "--json", tmp_path / "out.json", "--summary", tmp_path / "summary.md")
    assert result.exit_code == EXIT_FAIL
    assert "rank 17 after sync 3: 91.96 GB vs baseline 90.96 GB (+1.00 GB" in result.output
    data = json.loads((tmp_path / "out.json").read_text())
    by_id = {r["id"]: r for r in data["results"]}
    assert by_id["memory_returns_to_baseline"]["evidence"]["first_failing_rank"] == 17
    assert by_id["memory_returns_to_baseline"]["where"].startswith("metrics.jsonl:")
    assert data["tier"] == "full" and data["finished"] is True
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("### k3-harness: ❌ FAIL")
    assert "| ❌ FAIL | `memory_returns_to_baseline` | rank 17 after sync 3" in summary

    missing = H.write_run_dir(tmp_path / "missing", H.HEALTHY.but(with_memory=False))
    result = cli("check", missing)
    assert result.exit_code == EXIT_INCOMPLETE and "verdict: MISSING" in result.output


def test_check_a_running_run_and_a_recipe_log(tmp_path):
    running = H.write_run_dir(tmp_path / "running", H.HEALTHY.but(rollouts=3, finished=False))
    result = cli("check", running)
    assert result.exit_code == EXIT_INCOMPLETE and "verdict: PENDING" in result.output and "running)" in result.output
    result = cli("check", running, "--finished")
    assert result.exit_code == EXIT_INCOMPLETE and "verdict: MISSING" in result.output
    log = H.write_recipe_log(tmp_path / "train.log")
    result = cli("check", log, "--tier", "full")
    assert result.exit_code == EXIT_PASS, result.output
    assert "recipe_log, finished" in result.output


def test_check_reports_bad_lines_without_failing_on_them(tmp_path):
    lines = [json.dumps(e) for e in H.events(H.HEALTHY)]
    lines.insert(5, '{"time": 1.0, "event": "rollout", "rollout_id": 0, "rollout/raw_rew')
    path = H.write_run_dir(tmp_path / "run", H.HEALTHY, lines=lines)
    result = cli("check", path)
    assert result.exit_code == EXIT_PASS
    assert "1 line(s) could not be used (skipped):" in result.output
    assert "metrics.jsonl:6: not JSON" in result.output


def test_check_bad_input_exits_4(tmp_path):
    result = cli("check", tmp_path / "nope")
    assert result.exit_code == EXIT_INPUT and "no such file or directory" in result.output
    result = cli("check", H.write_run_dir(tmp_path / "run"), "--tier", "fastest")
    assert result.exit_code == EXIT_INPUT and "unknown tier 'fastest'" in result.output
    result = cli("check", H.write_run_dir(tmp_path / "run2"), "--profile", "h100")
    assert result.exit_code == EXIT_INPUT and "no hardware profile 'h100'" in result.output


def test_tier_follows_the_runs_variant(tmp_path):
    config = {"model_variant": "tiny", "expert_model_parallel_size": 1, "lora_base_cpu_backup": True,
              "colocate_memory_peak_device": "gpu"}
    s = H.HEALTHY.but(ranks=1, rollouts=10, config=config, cycle_seconds=lambda n: 20.0, startup_seconds=10.0,
                      eval_seconds=5.0, aime_solved={0: 3, 9: 9})
    result = cli("check", H.write_run_dir(tmp_path / "smoke", s))
    assert result.exit_code == EXIT_PASS, result.output
    assert "tiny K3 on CPU" in result.output


def test_watch_cli_kills_on_the_first_hard_fail(tmp_path):
    run = H.write_run_dir(tmp_path / "run", H.leaky(rank=5).but(ranks=8))
    marker = tmp_path / "stopped"
    result = cli("watch", run, "--kill-cmd", f"touch {marker}", "--poll", "0.01", "--timeout", "20")
    assert result.exit_code == EXIT_FAIL
    assert marker.exists()
    assert re.search(r"FIRST HARD FAIL at metrics\.jsonl:\d+ \(event \d+\):", result.output)
    assert "memory_returns_to_baseline: rank 5 after sync 3" in result.output
    assert f"kill command 'touch {marker}': exit 0" in result.output


def test_watch_cli_times_out_on_a_silent_run(tmp_path):
    run = H.write_run_dir(tmp_path / "run", H.HEALTHY.but(rollouts=2, finished=False, ranks=2))
    result = cli("watch", run, "--poll", "0.01", "--timeout", "0.2")
    assert result.exit_code == EXIT_INCOMPLETE and "timed out after 0.2 s" in result.output


def test_report_is_one_self_contained_html_file(tmp_path):
    run = H.write_run_dir(tmp_path / "run", H.leaky())
    result = cli("report", run, "--profile", "gb300")
    assert result.exit_code == EXIT_FAIL
    html = (run / "report.html").read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert len(images) == 4  # reward, AIME, memory, cycle time
    assert all(base64.b64decode(image).startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", html)  # nothing loaded from elsewhere
    for criterion in ("cycle_time", "memory_returns_to_baseline", "aime_rise_0_to_9", "config_lora_base_cpu_backup"):
        assert f"<code>{criterion}</code>" in html
    assert "rank 17 after sync 3" in html
    md = (run / "report.md").read_text()
    assert md.startswith("### k3-harness: ❌ FAIL") and md.count("\n| ") == 13  # header + 12 rows
    out = tmp_path / "elsewhere" / "r.html"
    result = cli("report", H.write_recipe_log(tmp_path / "train.log"), "--out", out)
    assert result.exit_code == EXIT_PASS and out.exists() and out.with_suffix(".md").exists()


def test_criteria_lists_the_tier():
    result = cli("criteria", "--tier", "full")
    assert result.exit_code == 0
    for text in ("cycle_time", "aime_at_0", "memory_absolute_gb300", "[profile gb300]", "returns_to_baseline"):
        assert text in result.output
    assert "exit codes: 0 every criterion PASS" in result.output


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("K3_CLUSTER_RUN", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(REPO / "tests" / "cluster" / "test_acceptance.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_pytest_plugin_one_test_per_criterion(tmp_path):
    run = H.write_run_dir(tmp_path / "run", H.leaky())
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    done = _pytest("--k3-run", str(run), "--k3-tier", "full", "--k3-profile", "gb300", "--k3-summary", str(summary),
                   f"--junitxml={junit}", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    cases = ET.parse(junit).getroot().iter("testcase")
    outcome = {c.get("name"): ("failed" if c.find("failure") is not None else "passed") for c in cases}
    assert len(outcome) == 12
    assert {n for n, o in outcome.items() if o == "failed"} == {
        "test_criterion[memory_returns_to_baseline]", "test_criterion[memory_no_growth]",
        "test_criterion[memory_absolute_gb300]"}
    assert "FAIL: rank 17 after sync 3" in done.stdout
    text = summary.read_text()
    assert text.startswith("### k3-harness: ❌ FAIL") and "`aime_at_0`" in text


def test_pytest_plugin_skips_without_a_run(tmp_path):
    done = _pytest(cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "11 skipped" in done.stdout


# --- make acceptance-full ---------------------------------------------------------------------------------
FAKE_RAY = """#!/usr/bin/env bash
# A stand-in for the ray CLI: `job submit` starts a writer of a leaky run, `job stop` leaves a mark.
echo "$*" >> "$FAKE_RAY_CALLS"
if [[ "$1 $2" == "job submit" ]]; then
  rundir=""; prev=""
  for a in "$@"; do [[ $prev == --run-dir ]] && rundir=$a; prev=$a; done
  "$FAKE_PYTHON" -c "import sys; sys.path.insert(0, '$FIXTURES'); import harness_runs as H; \\
from pathlib import Path; H.write_run_dir(Path('$rundir'), H.leaky(rank=3).but(ranks=4))"
fi
if [[ "$1 $2" == "job stop" ]]; then touch "$FAKE_RAY_STOPPED"; fi
exit 0
"""


def test_acceptance_full_without_a_cluster_stops_at_once():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(["bash", str(REPO / "ci" / "acceptance_full.sh")], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2
    assert "no Ray cluster: set RAY_ADDRESS" in done.stderr and "Nothing was submitted" in done.stderr


def test_acceptance_full_submits_watches_kills_and_reports(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "ray").chmod(0o755)
    venv = Path(sys.executable).parent
    for tool in ("k3-harness", "python"):
        (bin_dir / tool).symlink_to(venv / tool)
    run_dir, calls, stopped = tmp_path / "run", tmp_path / "calls", tmp_path / "stopped"
    env = {**os.environ, "RAY_ADDRESS": "http://head:8265", "BIN": str(bin_dir), "K3_RUN_DIR": str(run_dir),
           "K3_RUN_ID": "acc-1", "K3_HF_CHECKPOINT": "/ckpt/native", "K3_REF_LOAD": "/ckpt/dcp",
           "K3_DATA_DIR": "/data", "K3_REMOTE_PATHS": "1", "K3_WATCH_POLL": "0.2", "K3_WATCH_TIMEOUT": "60",
           "FAKE_RAY_CALLS": str(calls), "FAKE_RAY_STOPPED": str(stopped), "FAKE_PYTHON": sys.executable,
           "FIXTURES": str(REPO / "tests" / "fixtures"), "PYTHONPATH": str(REPO)}
    env.pop("GITHUB_STEP_SUMMARY", None)
    done = subprocess.run(["bash", str(REPO / "ci" / "acceptance_full.sh")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == EXIT_FAIL, done.stdout + done.stderr
    submit = calls.read_text().splitlines()[0]
    assert submit.startswith("job submit --address http://head:8265 --submission-id acc-1 --no-wait -- k3 train ")
    for flag in ("--mode normal --model-variant full --task dapo-math --reward-model deepscaler",
                 "--num-nodes 16 --num-gpus-per-node 4 --pipeline-parallel-size 8 --context-parallel-size 2",
                 "--rollout-tp-size 16 --rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64",
                 "--rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 4096",
                 "--sglang-max-total-tokens 65536 --global-batch-size 64 --lr 1e-05 --eval-interval 10",
                 "--distributed-timeout-minutes 60 --hf-checkpoint /ckpt/native --ref-load /ckpt/dcp"):
        assert flag in submit
    assert "job stop --address http://head:8265 acc-1" in calls.read_text() and stopped.exists()
    assert "FIRST HARD FAIL" in done.stdout and "rank 3 after sync 3" in done.stdout
    assert json.loads((run_dir / "verdict.json").read_text())["results"]
    assert (run_dir / "report.html").exists() and (run_dir / "summary.md").exists()
    assert ET.parse(run_dir / "acceptance.xml").getroot().iter("testcase")


# --- narrow terminals -------------------------------------------------------------------------------------
def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("tier", ["smoke", "gpu", "4layer", "full"])
def test_criteria_in_a_narrow_terminal_keeps_every_sentence_whole(tier, columns):
    from harness.tier import load_tier

    result = runner.invoke(app, ["criteria", "--tier", tier], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= columns
    out = _flat(result.output)
    for c in load_tier(tier).criteria:
        assert _flat(c.doc) in out, c.id
        assert " | ".join(c.metrics) in out and c.id in out


@pytest.mark.parametrize("columns", [80, 100])
def test_check_in_a_narrow_terminal_keeps_every_observation_whole(tmp_path, columns):
    from harness.criteria import evaluate_all
    from harness.readers import read_run
    from harness.tier import load_tier

    run = H.write_run_dir(tmp_path / "run", H.leaky())
    result = runner.invoke(app, ["check", str(run), "--profile", "gb300"], env={"COLUMNS": str(columns)})
    assert result.exit_code == EXIT_FAIL
    assert max(len(line) for line in result.output.splitlines()) <= columns
    out = _flat(result.output)
    for r in evaluate_all(load_tier("full").active("gb300"), read_run(run)):
        assert _flat(r.summary) in out, r.id
        assert r.where is None or f"at {r.where}" in out


def test_wide_terminals_keep_the_tables():
    result = runner.invoke(app, ["criteria", "--tier", "smoke"], env={"COLUMNS": "200"})
    assert "┃ id" in result.output and "┃ doc" in result.output
