"""Readers of the harness: tail-follow, safe dict literals, the run directory, the recipe's stdout log,
TensorBoard and W&B offline runs. Every malformed line must come back as a problem with file:line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.readers import ReaderError, open_source, read_run  # noqa: E402
from harness.readers.argument_dump import parse_dump_line  # noqa: E402
from harness.readers.follow import LineFollower  # noqa: E402
from harness.readers.python_literal import LiteralError, parse_dict_literal  # noqa: E402
from harness.readers.recipe_log import RecipeLogSource  # noqa: E402
from harness.readers.run_dir import RunDirSource  # noqa: E402
from harness.run_data import RunData, config_text, normalize_phase  # noqa: E402


# --- tail-follow ------------------------------------------------------------------------------------------
def test_follower_holds_back_a_partial_line_until_its_newline(tmp_path):
    path = tmp_path / "log"
    follower = LineFollower(path)
    assert follower.read() == []  # not there yet: nothing, no error
    path.write_bytes(b"one\ntw")
    assert [(x.number, x.text) for x in follower.read()] == [(1, "one")]
    with open(path, "ab") as f:
        f.write(b"o\nthree")
    assert [(x.number, x.text) for x in follower.read()] == [(2, "two")]
    assert follower.read() == []
    last = follower.read(final=True)
    assert [(x.number, x.text, x.partial) for x in last] == [(3, "three", True)]
    assert follower.offset == path.stat().st_size


def test_follower_refuses_a_file_that_shrank(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\nb\n")
    follower = LineFollower(path)
    follower.read()
    path.write_text("a\n")
    with pytest.raises(RuntimeError, match="shrank"):
        follower.read()


# --- literals ---------------------------------------------------------------------------------------------
def test_dict_literal_accepts_numpy_scalars_and_non_finite_floats():
    text = "{'a': np.float64(0.5), 'b': np.int64(3), 'c': nan, 'd': -inf, 'e': np.True_, 'f': [1, -2.5], 'g': 'x'}"
    value = parse_dict_literal(text)
    assert value["a"] == 0.5 and isinstance(value["a"], float)
    assert value["b"] == 3 and isinstance(value["b"], int)
    assert math.isnan(value["c"]) and value["d"] == -math.inf
    assert value["e"] is True and value["f"] == [1, -2.5] and value["g"] == "x"


@pytest.mark.parametrize("text", [
    "{'a': __import__('os').system('echo pwned')}",  # a call that is not a scalar type
    "{'a': os.environ}",  # a name that is not a literal
    "{'a': np.float64(open('x'))}",  # a scalar type around a non-literal
    "{'a': 1 + 2}",  # arithmetic is not a literal
    "{**x}",
    "[1, 2]",  # not a dict
    "{'a': 0.5, 'b': ",  # cut short
])
def test_dict_literal_rejects_everything_else(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LiteralError):
        parse_dict_literal(text)
    assert not (tmp_path / "x").exists()


def test_argument_dump_line_with_a_ray_prefix():
    assert parse_dump_line("  expert_model_parallel_size ...................... 8") == (
        "expert_model_parallel_size", "8")
    assert parse_dump_line("(MegatronTrainRayActor pid=12) [x]   lora_base_cpu_backup ..... True") == (
        "lora_base_cpu_backup", "True")
    assert parse_dump_line("  target_modules ... ['a', 'b']  ") == ("target_modules", "['a', 'b']")
    assert parse_dump_line("loading checkpoint... done") is None


def test_config_text_prints_values_as_megatron_does():
    assert [config_text(v) for v in (True, 8, 8.0, 1e-05, "gpu", None, [1, 2])] == [
        "True", "8", "8", "1e-05", "gpu", "None", "[1, 2]"]
    assert normalize_phase("after update_weights process-group cleanup") == "after_update_weights_process-group_cleanup"


# --- run directory ----------------------------------------------------------------------------------------
def test_run_dir_healthy_round_trip(tmp_path):
    run = read_run(H.write_run_dir(tmp_path / "run"))
    events = H.events(H.HEALTHY)
    assert run.kind == "run_dir" and run.finished and run.problems == []
    assert run.events == len(events) + 1  # + the resolved config
    reward = run.series("rollout/raw_reward")
    assert sorted(reward) == list(range(20))
    assert reward[0].value == H.HEALTHY.reward(0) and reward[0].where == "metrics.jsonl:132"
    memory = run.memory_series("after_update_weights", "memory/allocated_gb")
    assert len(memory) == 64 and all(sorted(syncs) == list(range(21)) for syncs in memory.values())
    assert memory[17][3].value == round(H.HEALTHY.memory(17, 3), 2)
    assert [s.version for s in run.syncs] == list(range(1, 22))
    assert run.config["lora_base_cpu_backup"].value == "True"
    assert run.config["expert_model_parallel_size"].value == "8"
    assert "env" not in run.config


def test_run_dir_reports_malformed_and_truncated_lines_with_file_and_line(tmp_path):
    good = [json.dumps(e) for e in H.events(H.HEALTHY.but(ranks=2, rollouts=2, with_eval=False))]
    lines = [good[0], "{not json", json.dumps([1, 2]), json.dumps({"event": "rollout", "rollout_id": 0}),
             json.dumps({"time": 1.0, "event": "bogus", "rollout_id": 0}),
             json.dumps({"time": 1.0, "event": "rollout", "rollout_id": -1}),
             json.dumps({"time": 1.0, "event": "memory", "rollout_id": 0, "phase": "after_update_weights"}),
             json.dumps({"time": 1.0, "event": "rollout", "rollout_id": 5, "rollout/raw_reward": None}),
             "", *good[1:]]
    path = H.write_run_dir(tmp_path / "run", H.HEALTHY, lines=lines)
    with open(path / "metrics.jsonl", "a") as f:
        f.write('{"time": 2.0, "event": "rollout", "rollo')  # the writer died mid-line
    run = read_run(path)
    problems = [str(p) for p in run.problems]
    assert problems[:6] == [
        "metrics.jsonl:2: not JSON: Expecting property name enclosed in double quotes at column 2; skipped",
        "metrics.jsonl:3: expected a JSON object, got list; skipped",
        "metrics.jsonl:4: missing 'time'; skipped",
        "metrics.jsonl:5: unknown event 'bogus' (expected one of rollout, train, eval, sync, memory, status, replicas); skipped",
        "metrics.jsonl:6: 'rollout_id' must be a non-negative integer or null, got -1; skipped",
        "metrics.jsonl:7: memory event needs an integer 'rank', got None; skipped",
    ]
    assert problems[6] == "metrics.jsonl:8: rollout/raw_reward is null (non-finite when written); counted as NaN"
    assert problems[7].startswith(f"metrics.jsonl:{len(lines) + 1}: truncated line (no newline at the end")
    assert len(problems) == 8
    assert math.isnan(run.series("rollout/raw_reward")[5].value)
    assert sorted(run.series("rollout/raw_reward")) == [0, 1, 5]  # the good lines around the bad ones count


def test_run_dir_follows_a_growing_file(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    source, run = RunDirSource(path), RunData()
    assert source.read(run) == 0  # nothing written yet
    lines = [json.dumps(e) for e in H.events(H.HEALTHY.but(ranks=2, rollouts=3))]
    metrics = path / "metrics.jsonl"
    metrics.write_text(lines[0] + "\n" + lines[1][:10])
    assert source.read(run) == 1 and run.problems == []
    with open(metrics, "a") as f:
        f.write(lines[1][10:] + "\n" + "\n".join(lines[2:]) + "\n")
    assert source.read(run) == len(lines) - 1
    (path / "resolved_config.json").write_text(json.dumps({"max_tokens_per_gpu": 8192}))
    assert source.read(run) == 1 and run.config["max_tokens_per_gpu"].value == "8192"
    assert run.finished and run.problems == []


def test_run_dir_config_from_the_text_dump_when_there_is_no_json(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "resolved_config.txt").write_text(
        "------------------------ arguments ------------------------\n"
        "  colocate_memory_peak_device ..................... gpu\n"
        "  expert_model_parallel_size ...................... 8\n"
        "-------------------- end of arguments ---------------------\n")
    run = read_run(path)
    assert {k: (e.value, e.where) for k, e in run.config.items()} == {
        "colocate_memory_peak_device": ("gpu", "resolved_config.txt:2"),
        "expert_model_parallel_size": ("8", "resolved_config.txt:3")}


def test_duplicate_values_keep_the_first_and_are_reported(tmp_path):
    e = {"time": 1.0, "event": "rollout", "rollout_id": 0}
    lines = [json.dumps(e | {"rollout/raw_reward": 0.6}), json.dumps(e | {"rollout/raw_reward": 0.9})]
    run = read_run(H.write_run_dir(tmp_path / "run", H.HEALTHY, lines=lines))
    assert run.series("rollout/raw_reward")[0].value == 0.6
    assert [str(p) for p in run.problems] == [
        "metrics.jsonl:2: rollout/raw_reward of rollout 0 logged again (0.9; first 0.6 at metrics.jsonl:1); "
        "keeping the first"]


# --- the public recipe's stdout log -----------------------------------------------------------------------
def test_recipe_log_with_interleaved_ranks(tmp_path):
    s = H.leaky(rank=17, from_sync=3)
    lines = H.recipe_log_lines(s, seed=3)
    run = read_run(H.write_recipe_log(tmp_path / "train.log", s, lines))
    assert run.kind == "recipe_log" and run.finished and run.problems == []
    memory = run.memory_series("after update_weights", "memory/allocated_gb")
    assert sorted(memory) == list(range(64))
    # The k-th line of a rank is sync k, whatever order the ranks printed in.
    assert [memory[17][k].value for k in range(5)] == [90.96, 90.96, 90.96, 91.96, 92.96]
    assert memory[5][20].value == 90.96
    # The shuffle really interleaved them: rank 17's line is not at the same offset in every block.
    positions = {int(memory[17][k].where.split(":")[1]) - int(memory[0][k].where.split(":")[1]) for k in range(5)}
    assert len(positions) > 1
    assert [x.version for x in run.syncs] == list(range(1, 22)) and run.syncs[0].chunks == 12
    assert run.series("rollout/raw_reward")[0].value == s.reward(0)
    assert run.series("eval/aime")[9].value == 14 / 30
    assert run.series("perf/step_time")[10].value == pytest.approx(720 + 6 * 2 + 300)
    assert run.config["lora_base_cpu_backup"].value == "True"
    assert run.config["max_tokens_per_gpu"].where == "train.log:8"


def test_recipe_log_reports_garbled_and_truncated_lines(tmp_path):
    lines = H.recipe_log_lines(H.HEALTHY.but(ranks=2, rollouts=1, with_eval=False))
    memory_index = next(i for i, x in enumerate(lines) if "Memory-Usage" in x)
    garbled = lines[memory_index][:105] + lines[memory_index + 1]  # two ranks' writes run together
    first_rank = int(lines[memory_index].split("[Rank ")[1].split("]")[0])
    second_rank = int(lines[memory_index + 1].split("[Rank ")[1].split("]")[0])
    lines = lines[:memory_index] + [garbled] + lines[memory_index + 2:] + [
        "(RolloutManager pid=99) perf 7: {'perf/rollout_time': 12.0, 'rollout/x': ",
        "[Rank 3] Memory-Usage after update_weights {'allocated_GB': 90.9}",  # no colon
        "LoRA weight version seven sent",
        "eval 3: {'eval/aime': __import__('os').getcwd()}",
    ]
    path = H.write_recipe_log(tmp_path / "train.log", lines=lines)
    with open(path, "a") as f:
        f.write("(pid=1) rollout 9: {'rollout/raw_reward': np.float64(0.")
    run = read_run(path)
    problems = [str(p) for p in run.problems]
    n = len(lines)
    assert problems[0].startswith(f"train.log:{memory_index + 1}: fragment of rank {first_rank}'s output "
                                  f"('[Rank {first_rank}] Memory-(MegatronTrainRayActor")
    assert problems[0].endswith("several ranks' writes ran together on this line; skipped")
    memory = run.memory_series("after_update_weights", "memory/allocated_gb")
    # The whole piece is kept, the fragment is lost (and reported): that rank has one reading fewer.
    assert len(memory[second_rank]) == 2 and len(memory[first_rank]) == 1
    assert problems[1].startswith(f"train.log:{n - 3}: 'perf 7: {{…}}' does not parse")
    assert problems[2].startswith(f"train.log:{n - 2}: Memory-Usage line not in the form")
    assert problems[3].startswith(f"train.log:{n - 1}: LoRA sync line not in the form")
    assert problems[4].startswith(f"train.log:{n}: 'eval 3: {{…}}' does not parse: call of \"__import__('os').getcwd\"")
    assert problems[5].startswith(f"train.log:{n + 1}: 'rollout 9: {{…}}' does not parse")
    assert problems[5].endswith("(the file ends inside this line: truncated); skipped")
    assert len(problems) == 6
    assert 7 not in run.series("perf/rollout_time") and 9 not in run.series("rollout/raw_reward")


def test_recipe_log_while_it_grows(tmp_path):
    lines = H.recipe_log_lines(H.HEALTHY.but(ranks=2, rollouts=2))
    path = tmp_path / "train.log"
    source, run = RecipeLogSource(path), RunData()
    path.write_text("\n".join(lines[:10]) + "\n" + lines[10][:20])
    source.read(run)
    assert run.problems == []
    with open(path, "a") as f:
        f.write(lines[10][20:] + "\n" + "\n".join(lines[11:]) + "\n")
    source.read(run, final=True)
    assert run.problems == [] and len(run.syncs) == 3


def test_open_source_picks_the_reader(tmp_path):
    run_dir = H.write_run_dir(tmp_path / "run")
    assert open_source(run_dir).kind == "run_dir"
    assert open_source(run_dir / "metrics.jsonl").kind == "run_dir"
    assert open_source(H.write_recipe_log(tmp_path / "train.log")).kind == "recipe_log"
    with pytest.raises(ReaderError, match="no such file"):
        open_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReaderError, match="no metrics.jsonl"):
        open_source(tmp_path / "empty")


# --- TensorBoard ------------------------------------------------------------------------------------------
def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path / "tb"))
    for step in range(3):
        values = [summary_pb2.Summary.Value(tag="rollout/raw_reward", simple_value=0.5 + step / 8)]
        if step == 0:
            values.append(summary_pb2.Summary.Value(tag="eval/aime", simple_value=11 / 30))
        writer.add_event(event_pb2.Event(wall_time=H.T0 + step, step=step, summary=summary_pb2.Summary(value=values)))
    writer.close()
    run = read_run(tmp_path / "tb")
    assert run.kind == "tensorboard" and run.finished and run.problems == []
    assert {i: p.value for i, p in run.series("rollout/raw_reward").items()} == {0: 0.5, 1: 0.625, 2: 0.75}
    assert run.series("eval/aime")[0].value == pytest.approx(11 / 30, abs=1e-7)  # float32 in the file
    assert run.series("rollout/raw_reward")[2].time == pytest.approx(H.T0 + 2)
    assert run.events == 3  # one event per step


def test_tensorboard_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    from harness.readers import ReaderUnavailable
    from harness.readers.tensorboard import TensorBoardSource

    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing", None)
    source = TensorBoardSource(tmp_path)
    for _ in range(2):  # the failed start leaves the source unread: it fails again rather than reading nothing
        with pytest.raises(ReaderUnavailable, match="needs the 'tensorboard' package"):
            source.read(RunData())


# --- W&B offline ------------------------------------------------------------------------------------------
def test_wandb_offline_run(tmp_path):
    wandb = pytest.importorskip("wandb")
    run_obj = wandb.init(project="k3", dir=str(tmp_path), mode="offline",
                         config={"expert_model_parallel_size": 8, "lora_base_cpu_backup": True})
    for step in range(3):
        run_obj.log({"rollout/raw_reward": 0.5 + step / 10, "rollout/step": step})
    run_obj.log({"eval/aime": 11 / 30, "eval/step": 0})
    run_obj.finish()
    run = read_run(tmp_path / "wandb")
    assert run.kind == "wandb" and run.problems == []
    assert {i: p.value for i, p in run.series("rollout/raw_reward").items()} == {0: 0.5, 1: 0.6, 2: 0.7}
    assert run.series("eval/aime")[0].value == pytest.approx(11 / 30)
    assert run.config["lora_base_cpu_backup"].value == "True"
    assert run.config["expert_model_parallel_size"].value == "8"


def test_wandb_framing_errors_are_reported(tmp_path):
    from harness.readers.wandb_offline import HEADER, _records

    run = RunData()
    good = b"\x00\x00\x00\x00" + (3).to_bytes(2, "little") + b"\x01" + b"abc"
    cut = b"\x00\x00\x00\x00" + (50).to_bytes(2, "little") + b"\x01" + b"xy"
    path = tmp_path / "run-x.wandb"
    path.write_bytes(HEADER + good + cut)
    assert _records(run, path) == [b"abc"]
    assert [str(p) for p in run.problems] == [
        "run-x.wandb:byte 24: chunk of 50 bytes runs past the end of the file or its block (truncated or "
        "corrupt); the rest is skipped"]
    path.write_bytes(b"garbage")
    with pytest.raises(ReaderError, match="not a W&B transaction log"):
        _records(RunData(), path)


def test_run_dir_json_error_that_ends_in_at_reads_once(tmp_path):
    good = [json.dumps(e) for e in H.events(H.HEALTHY.but(ranks=1, rollouts=1, with_eval=False))]
    path = H.write_run_dir(tmp_path / "run", H.HEALTHY, lines=[good[0], '{"event": "rollout', *good[1:]])
    problems = [str(p) for p in read_run(path).problems]
    assert "metrics.jsonl:2: not JSON: Unterminated string starting at column 11; skipped" in problems
