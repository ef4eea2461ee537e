"""The resolved-config files (Megatron-style argument dump + JSON), the "Argument | Value" table, and the
`k3 train` command around them: run-directory rules, resume, input checks, hand-off to the loop."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import sys
import types

import pytest
import typer
from typer.testing import CliRunner

from k3.launch import train as train_cmd
from k3.launch.args import TrainArgs, resolve
from k3.launch.parser import parse_train_args
from k3.launch.resolved_config import (
    format_argument_dump,
    layout_summary,
    print_args_table,
    read_resolved_config,
    write_resolved_config,
)

# Megatron's dump line: two spaces, the name, a space, dots, a space, the value.
DUMP_LINE = re.compile(r"^  (\S+) \.+ (.*)$")

VALIDATED_LAUNCH = (
    "--mode normal --model-variant full --task dapo-math --reward-model deepscaler "
    "--num-nodes 16 --num-gpus-per-node 4 --pipeline-parallel-size 8 --context-parallel-size 2 "
    "--rollout-tp-size 16 --rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64 "
    "--num-rollout 1000 --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 4096 "
    "--sglang-max-total-tokens 65536 --global-batch-size 64 --lr 1e-05 --eval-interval 10 "
    "--distributed-timeout-minutes 60 --enable-wandb --run-id validated"
).split()


def parse_dump(text: str) -> dict[str, str]:
    lines = text.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    pairs = {}
    for line in lines[1:-1]:
        m = DUMP_LINE.match(line)
        assert m, line
        pairs[m.group(1)] = m.group(2)
    return pairs


def test_argument_dump_layout_is_megatrons():
    text = format_argument_dump({"lr": 1e-05, "Zeta": None, "expert_model_parallel_size": 8, "flag": True,
                                 "names": ["a", "b"], "x" * 50: 1})
    assert text == (
        "------------------------ arguments ------------------------\n"
        f"  expert_model_parallel_size {'.' * 22} 8\n"
        f"  flag {'.' * 44} True\n"
        f"  lr {'.' * 46} 1e-05\n"
        f"  names {'.' * 43} ['a', 'b']\n"
        f"  {'x' * 50} . 1\n"
        f"  Zeta {'.' * 44} None\n"
        "-------------------- end of arguments ---------------------\n"
    )


def test_validated_launch_dump_has_the_recipe_lines(tmp_path):
    resolved = resolve(parse_train_args(VALIDATED_LAUNCH, environ={}))
    json_path, text_path = write_resolved_config(resolved, tmp_path)
    pairs = parse_dump(text_path.read_text())
    # The four lines the recipe page says to check, as name/value pairs.
    for name, value in [("expert_model_parallel_size", "8"), ("max_tokens_per_gpu", "8192"),
                        ("colocate_memory_peak_device", "gpu"), ("lora_base_cpu_backup", "True")]:
        assert pairs[name] == value
    assert re.search(r"^  expert_model_parallel_size \.+ 8$", text_path.read_text(), re.M)
    expected = {"tensor_model_parallel_size": "4", "pipeline_model_parallel_size": "8",
                "context_parallel_size": "2", "data_parallel_size": "1", "expert_tensor_parallel_size": "1",
                "lora_rank": "32", "lora_alpha": "64", "decoder_first_pipeline_num_layers": "12",
                "decoder_last_pipeline_num_layers": "9", "world_size": "64", "lr": "1e-05"}
    assert {k: pairs[k] for k in expected} == expected
    assert "env" not in pairs
    assert list(pairs) == sorted(pairs, key=str.lower)
    # JSON: every resolved value, round-tripped.
    saved = json.loads(json_path.read_text())
    assert saved == json.loads(json.dumps(resolved.to_dict()))
    assert saved["expert_model_parallel_size"] == 8 and saved["lora_base_cpu_backup"] is True
    assert saved["pipeline_layers"] == [12] * 7 + [9]
    assert read_resolved_config(tmp_path) == saved
    assert set(pairs) == set(saved) - {"env"}


def test_to_dict_holds_every_flag_and_section():
    d = resolve(TrainArgs(run_id="t")).to_dict()
    for f in dataclasses.fields(TrainArgs):
        assert f.name in d, f.name
    for key in ("tensor_model_parallel_size", "eps_clip_high", "prompt_data", "num_steps_per_rollout", "optimizer",
                "rollout_temperature", "env"):
        assert key in d
    # Settings fields nothing applies are left out (k3.launch.resolved_keys.NOT_PRINTED).
    assert "train_memory_margin_bytes" not in d
    assert (d["optimizer"], d["sgd_momentum"]) == ("sgd", 0.0)  # debug_minimal's SGD, which both trainers build
    # An even split passes no first/last sizes.
    assert d["decoder_first_pipeline_num_layers"] is None and d["decoder_last_pipeline_num_layers"] is None


def test_layout_summary():
    resolved = resolve(parse_train_args(VALIDATED_LAUNCH, environ={}))
    assert layout_summary(resolved) == (
        "TP4 × CP2 × PP8 × DP1 = 64 GPU ranks, EP8, ETP1; layers/stage 12×7 + 9; rollout 4 × TP16/EP1")
    tiny = resolve(TrainArgs(model_variant="tiny", run_id="t"))
    assert layout_summary(tiny) == "TP1 × CP1 × PP1 × DP1 = 1 CPU rank, EP1, ETP1; layers/stage 9; rollout 1 × TP1/EP1"


def test_args_table_prints_every_flag():
    from rich.console import Console

    resolved = resolve(TrainArgs(run_id="t", extra_env_vars="A='[not markup]'", lr=3e-5))
    console = Console(file=io.StringIO(), width=200, record=True)
    print_args_table(resolved, console)
    text = console.export_text()
    assert "Argument" in text and "Value" in text
    for f in dataclasses.fields(TrainArgs):
        assert f.name in text, f.name
    assert re.search(r"│ extra_env_vars\s+│ A='\[not markup\]'", text)
    assert "layout: TP8 × CP1 × PP1 × DP1 = 8 GPU ranks, EP8, ETP1" in text
    assert "note: --lr 3e-05 is ignored in --mode debug_minimal" in text


# --------------------------------------------------------------------------- the `k3 train` command
@pytest.fixture
def tiny_inputs(tmp_path):
    """A tiny run's inputs: a tiny BF16 checkpoint and the dapo-math / aime files."""
    from k3.checkpoint.synth import write_synthetic_checkpoint
    from k3.config import variant

    # the tiny BF16 checkpoint in the released layout: the dry run reads its config and shard headers
    ckpt = write_synthetic_checkpoint(variant("tiny"), tmp_path / "ckpt", "bf16", seed=0, progress=False)
    data = tmp_path / "data"
    for rel in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (data / rel).parent.mkdir(parents=True)
        (data / rel).write_text('{"prompt": "1+1", "label": "2"}\n')
    run_dir = tmp_path / "run"
    argv = ["--model-variant", "tiny", "--task", "dapo-math", "--hf-checkpoint", str(ckpt), "--data-dir",
            str(data), "--eval-interval", "2", "--run-dir", str(run_dir), "--run-id", "tiny1"]
    return argv, run_dir


@pytest.fixture
def fake_loop(monkeypatch):
    calls = []
    module = types.ModuleType("k3.rl.loop")
    module.run = lambda settings, **kwargs: calls.append(settings)
    monkeypatch.setitem(sys.modules, "k3.rl.loop", module)
    return calls


def test_train_writes_config_and_hands_the_run_to_the_loop(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv) == 0
    assert len(fake_loop) == 1
    settings = fake_loop[0]  # the loop gets the run's typed settings
    assert settings.run_id == "tiny1" and settings.layout.world_size == 1
    assert read_resolved_config(run_dir)["run_id"] == "tiny1"
    assert parse_dump((run_dir / "resolved_config.txt").read_text())["model_variant"] == "tiny"
    assert "layout: TP1 × CP1 × PP1 × DP1 = 1 CPU rank" in capsys.readouterr().out


def test_train_without_the_loop_says_so(tiny_inputs, monkeypatch, capsys):
    argv, run_dir = tiny_inputs
    monkeypatch.setitem(sys.modules, "k3.rl.loop", None)  # import fails as for a missing module
    assert train_cmd.main(argv) == 2
    assert "training loop not available yet (k3.rl.loop is missing)" in capsys.readouterr().err
    assert (run_dir / "resolved_config.json").is_file()


def test_dry_run_checks_inputs(tiny_inputs, tmp_path, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv + ["--dry-run"]) == 0
    assert "dry run: configuration valid, inputs present; not training" in capsys.readouterr().out
    bad = ["--model-variant", "tiny", "--task", "dapo-math", "--data-dir", str(tmp_path / "nothing"),
           "--run-dir", str(tmp_path / "run2"), "--dry-run"]
    assert train_cmd.main(bad) == 1
    err = capsys.readouterr().err
    assert ("--hf-checkpoint is required for --model-variant tiny: make one with `k3 make-checkpoint --variant "
            "tiny --format bf16 --out DIR` and pass --hf-checkpoint DIR") in err
    assert (f"training data {tmp_path}/nothing/dapo-math-17k/dapo-math-17k.jsonl not found: run `k3 prepare-data "
            f"--task dapo-math --data-dir {tmp_path}/nothing`") in err


def test_missing_inputs_stop_a_real_run(tiny_inputs, tmp_path, fake_loop, capsys):
    argv, _ = tiny_inputs
    argv = argv[:argv.index("--hf-checkpoint")] + ["--hf-checkpoint", str(tmp_path / "gone")] + \
        argv[argv.index("--hf-checkpoint") + 2:]
    assert train_cmd.main(argv) == 2
    assert f"--hf-checkpoint {tmp_path}/gone does not exist" in capsys.readouterr().err
    assert fake_loop == []


def test_bad_configuration_exits_2_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert train_cmd.main(["--model-variant", "full", "--run-dir", str(run_dir)]) == 2
    assert "k3 train: error: --model-variant full requires --num-nodes 16" in capsys.readouterr().err
    assert not run_dir.exists()


def test_existing_run_needs_resume(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv) == 0
    before = (run_dir / "resolved_config.json").read_text()
    assert train_cmd.main(argv) == 2
    assert (f"--run-dir {run_dir} already holds a run (resolved_config.json): pass --resume to continue it, or "
            "choose another --run-dir / --run-id") in capsys.readouterr().err
    assert (run_dir / "resolved_config.json").read_text() == before  # nothing overwritten


def test_resume_keeps_the_run_id_and_rejects_incompatible_flags(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv) == 0
    # The fake loop saves nothing; --resume needs a checkpoint to continue from (its files are the loop's to check).
    (run_dir / "adapters" / "rollout_000000").mkdir(parents=True)
    (run_dir / "adapters" / "rollout_000000" / "trainer_state.pt").write_bytes(b"")
    no_id = [w for i, w in enumerate(argv) if w != "--run-id" and (i == 0 or argv[i - 1] != "--run-id")]
    assert train_cmd.main(no_id + ["--resume", "--num-rollout", "5"]) == 0
    resumed = fake_loop[-1]
    assert resumed.run_id == "tiny1" and resumed.num_rollout == 5 and resumed.resume is True
    out = capsys.readouterr().out
    assert "resume: num_rollout 2 -> 5" in out
    assert json.loads((run_dir / "resolved_config.previous.json").read_text())["num_rollout"] == 2
    assert train_cmd.main(no_id + ["--resume", "--lora-rank", "8"]) == 2
    assert ("--resume: the saved adapters do not fit the new flags (lora_rank was 16, now 8): resume with the run's "
            "values, or start a new run") in capsys.readouterr().err


def test_resume_needs_an_existing_run(tmp_path, capsys):
    assert train_cmd.main(["--resume"]) == 2
    assert "--resume needs the run to continue: pass --run-dir DIR (or --run-id ID)" in capsys.readouterr().err
    assert train_cmd.main(["--resume", "--run-dir", str(tmp_path / "none")]) == 2
    assert f"--resume: {tmp_path}/none has no resolved_config.json" in capsys.readouterr().err


def test_k3_train_help_is_the_argparse_help():
    app = typer.Typer()
    app.command("train", **train_cmd.train.command_settings)(train_cmd.train)
    app.command("other")(lambda: None)
    result = CliRunner().invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "usage: k3 train" in text
    assert "--rollout-max-concurrency N requests an engine runs at once [default: 64; env K3_ROLLOUT_MAX_CONCURRENCY]" \
        in text
    bad = CliRunner().invoke(app, ["train", "--model-variant", "full"])
    assert bad.exit_code == 2
