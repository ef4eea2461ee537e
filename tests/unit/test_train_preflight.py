"""`k3 train` checks everything before it touches the run directory, and a start that fails never blocks its
own fix: a wrong --hf-checkpoint, --dry-run, --enable-wandb without wandb, an empty or malformed train.jsonl,
--lr nan, --resume with no checkpoint yet; and one owner per run directory (two processes)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from k3.launch import preflight
from k3.launch import train as train_cmd
from k3.launch.args import TrainArgs, resolve
from k3.launch.run_lock import LOCK_NAME, RunDirectoryBusy, RunLock, holder_of

ROOT = Path(__file__).resolve().parents[2]


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
    """A loop that records the run, and writes its metrics.jsonl as the real one does (``failing``: a start
    that fails before any work: started, failed)."""
    calls = []
    module = types.ModuleType("k3.rl.loop")

    class TrainingError(RuntimeError):
        pass

    def run(resolved, **_kwargs):  # the run settings; in_process, start_placement, … as k3.rl.loop.run
        calls.append(resolved)
        metrics = resolved.run_dir / "metrics.jsonl"
        with metrics.open("a") as f:
            f.write(json.dumps({"time": 1.0, "event": "status", "rollout_id": None, "status": "started"}) + "\n")
            if module.failing:
                f.write(json.dumps({"time": 2.0, "event": "status", "rollout_id": None, "status": "failed",
                                    "error": "RuntimeError: Ray did not start"}) + "\n")
                raise TrainingError("Ray did not start")
            f.write(json.dumps({"time": 2.0, "event": "rollout", "rollout_id": 0, "rollout/raw_reward": 0.5}) + "\n")

    module.run, module.TrainingError, module.failing = run, TrainingError, False
    monkeypatch.setitem(sys.modules, "k3.rl.loop", module)
    return module, calls


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


# --------------------------------------------------------------------------- a failed start blocks nothing
def test_a_wrong_hf_checkpoint_writes_nothing_and_the_corrected_command_runs(tiny_inputs, tmp_path, fake_loop,
                                                                          capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(_with(argv, "--hf-checkpoint", str(tmp_path / "gone"))) == 2
    assert f"--hf-checkpoint {tmp_path}/gone does not exist" in capsys.readouterr().err
    assert not run_dir.exists()
    broken = tmp_path / "broken-ckpt"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert train_cmd.main(_with(argv, "--hf-checkpoint", str(broken))) == 2
    assert f"--hf-checkpoint {broken}: config.json is not JSON" in capsys.readouterr().err
    assert not run_dir.exists()
    assert train_cmd.main(argv) == 0  # the corrected command, no --resume
    assert len(fake_loop[1]) == 1


def test_a_dry_run_writes_nothing_and_the_real_run_follows(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv + ["--dry-run"]) == 0
    assert "configuration valid, inputs present; not training; nothing written" in capsys.readouterr().out
    assert not run_dir.exists()
    assert train_cmd.main(argv) == 0
    assert (run_dir / "resolved_config.json").is_file() and len(fake_loop[1]) == 1


def test_enable_wandb_without_wandb_is_refused_before_writing(tiny_inputs, fake_loop, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    argv, run_dir = tiny_inputs
    for extra, code in ((["--dry-run"], 1), ([], 2)):
        assert train_cmd.main(argv + ["--enable-wandb", *extra]) == code
        assert "--enable-wandb needs wandb, which is not installed" in capsys.readouterr().err
        assert not run_dir.exists()
    assert train_cmd.main(argv) == 0 and len(fake_loop[1]) == 1


@pytest.mark.parametrize("content, message", [
    ("", "no records"),
    ("\n\n", "no records"),
    ('{"prompt": "1+1", "label": "2"}\n{"prompt": "2+2", "label": }\n', ":2: not valid JSON (Expecting value "
                                                                         "at column 28)"),
    ('{"prompt": "1+1"}\n', ":1: missing key 'label'"),
    ('["1+1", "2"]\n', ":1: expected a JSON object, got list"),
])
def test_an_empty_or_malformed_train_jsonl_is_refused_before_writing(tiny_inputs, fake_loop, capsys, content,
                                                                    message):
    argv, run_dir = tiny_inputs
    data = Path(argv[argv.index("--data-dir") + 1]) / "dapo-math-17k" / "dapo-math-17k.jsonl"
    data.write_text(content)
    assert train_cmd.main(argv + ["--dry-run"]) == 1  # the dry run finds it too
    err = capsys.readouterr().err
    assert f"training data {data}" in err and message in err and "Traceback" not in err
    assert train_cmd.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists() and fake_loop[1] == []


def test_malformed_eval_data_is_refused_too(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    data = Path(argv[argv.index("--data-dir") + 1]) / "aime-2024" / "aime-2024.jsonl"
    data.write_text('{"prompt": "", "label": "2"}\n')
    assert train_cmd.main(argv) == 2
    assert f"eval data {data}: 1 bad record(s)" in capsys.readouterr().err and not run_dir.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "1e999", "NaN"])
def test_a_non_finite_lr_is_refused_at_parse_time(tiny_inputs, capsys, value):
    argv, run_dir = tiny_inputs
    with pytest.raises(SystemExit) as e:
        train_cmd.main(argv + ["--lr", value])
    assert e.value.code == 2
    assert f"argument --lr: '{value}' is not a finite number" in capsys.readouterr().err
    assert not run_dir.exists()


def test_a_non_finite_number_from_the_environment_or_python_is_refused(tiny_inputs, monkeypatch, capsys):
    argv, run_dir = tiny_inputs
    monkeypatch.setenv("K3_LORA_DROPOUT", "nan")
    assert train_cmd.main(argv) == 2
    assert "K3_LORA_DROPOUT='nan': not a finite number for --lora-dropout" in capsys.readouterr().err
    resolved = resolve(TrainArgs(mode="normal", model_variant="tiny", run_id="t", lr=math.inf))
    assert preflight.non_finite_flags(resolved) == ["--lr inf: must be a finite number"]
    assert not run_dir.exists()


def test_a_start_that_failed_before_any_work_is_reused_by_the_next_run(tiny_inputs, fake_loop, capsys):
    module, calls = fake_loop
    argv, run_dir = tiny_inputs
    module.failing = True
    assert train_cmd.main(argv) == 1
    assert "k3 train: error: Ray did not start" in capsys.readouterr().err
    module.failing = False
    assert train_cmd.main(argv) == 0  # no --resume, no deleting by hand
    assert "held a start that failed before any work; its events are kept in metrics.failed-start-1.jsonl" in \
        capsys.readouterr().out
    assert [json.loads(line)["status"] for line in (run_dir / "metrics.failed-start-1.jsonl").read_text().split(
        "\n") if line] == ["started", "failed"]
    assert [json.loads(line)["event"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        "status", "rollout"]
    # A run that did work is a run: never reused without --resume.
    assert train_cmd.main(argv) == 2
    assert "already holds a run (resolved_config.json, metrics.jsonl)" in capsys.readouterr().err


# --------------------------------------------------------------------------- --resume with nothing to resume
def test_resume_without_a_checkpoint_refuses_in_one_line(tiny_inputs, fake_loop, capsys):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv + ["--save-interval", "5"]) == 0  # the (fake) run saved nothing
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    for extra in ([], ["--dry-run"]):
        assert train_cmd.main(argv + ["--resume", *extra]) == 1
        captured = capsys.readouterr()
        assert captured.err == (f"k3 train: error: --resume: {run_dir} has no adapter checkpoint to continue from "
                                "(the run saves one every --save-interval 5 rollouts and had saved none): start the "
                                "run again in a new --run-dir, or remove this one\n")
        assert captured.out == ""
    assert (run_dir / "metrics.jsonl").read_text() == before and len(fake_loop[1]) == 1


# --------------------------------------------------------------------------- one owner per run directory
_HOLDER = textwrap.dedent("""
    import sys, time
    from k3.launch.run_lock import RunLock
    lock = RunLock.acquire(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder(tmp_path):
    """Another process holding a run directory's lock (as a running `k3 train` does)."""
    procs = []

    def start(run_dir: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                                env=env)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_a_second_k3_train_into_a_held_directory_is_refused_naming_the_holder(tiny_inputs, fake_loop, holder,
                                                                            capsys):
    argv, run_dir = tiny_inputs
    proc = holder(run_dir)
    who = f"pid {proc.pid} on host {socket.gethostname()}"
    assert holder_of(run_dir) == who
    assert train_cmd.main(argv) == 1
    err = capsys.readouterr().err
    assert f"--run-dir {run_dir} is in use by another k3 train ({who}, lock {run_dir / LOCK_NAME})" in err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # nothing written
    assert train_cmd.main(argv + ["--dry-run"]) == 1
    assert f"is in use by another k3 train ({who}, lock" in capsys.readouterr().err
    # The lock dies with its holder, kill -9 included: the directory is free again.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert holder_of(run_dir) is None
    assert train_cmd.main(argv) == 0 and len(fake_loop[1]) == 1


def test_two_real_k3_train_processes_into_one_directory(tiny_inputs, tmp_path):
    """Two `k3 train` processes at once (a loop that waits, so the first is still running when the second comes):
    the second exits 1 naming the first's pid; metrics.jsonl has the first's lines only."""
    argv, run_dir = tiny_inputs
    script = textwrap.dedent("""
        import sys, time, types, json
        module = types.ModuleType("k3.rl.loop")
        class TrainingError(RuntimeError):
            pass
        def run(resolved, **_kwargs):
            with open(resolved.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"event": "status", "status": "started"}) + "\\n")
            print("running", flush=True)
            time.sleep(float(sys.argv[1]))
        module.run, module.TrainingError = run, TrainingError
        sys.modules["k3.rl.loop"] = module
        from k3.launch.train import main
        sys.exit(main(sys.argv[2:]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    first = subprocess.Popen([sys.executable, "-c", script, "60", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        for line in first.stdout:
            if line.strip() == "running":
                break
            assert time.monotonic() < deadline
        second = subprocess.run([sys.executable, "-c", script, "0", *argv, "--resume"], capture_output=True,
                                text=True, env=env, timeout=120)
        assert second.returncode == 1, second.stderr
        assert f"is in use by another k3 train (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert (run_dir / "metrics.jsonl").read_text().count("started") == 1
    finally:
        first.kill()
        first.wait(timeout=10)


def test_the_lock_is_exclusive_in_one_process_and_released(tmp_path):
    with RunLock.acquire(tmp_path / "run") as lock:
        assert lock.held and holder_of(tmp_path / "run") == f"pid {os.getpid()} on host {socket.gethostname()}"
        with pytest.raises(RunDirectoryBusy, match=f"pid {os.getpid()} on host"):
            RunLock.acquire(tmp_path / "run")  # flock locks are per open file: a second open is refused too
    assert not lock.held and holder_of(tmp_path / "run") is None
    assert holder_of(tmp_path / "never") is None and not (tmp_path / "never").exists()



# --------------------------------------------------------------------------- flags nothing would apply
@pytest.mark.parametrize("extra, message", [
    (["--ref-load", "/models/dcp"], "--ref-load /models/dcp is applied only with --backend megatron (this run: "
                                    "--backend torch): add --backend megatron, or drop --ref-load"),
    (["--sglang-max-total-tokens", "65536"], "--sglang-max-total-tokens 65536 is applied only with --rollout-engine "
                                             "sglang (this run: --rollout-engine embedded): add --rollout-engine "
                                             "sglang, or drop --sglang-max-total-tokens"),
    (["--check-weight-update-equal"], "--check-weight-update-equal True is applied only with --rollout-engine sglang"),
    (["--sglang-path", "/sgl"], "--sglang-path /sgl is applied only with --rollout-engine sglang"),
    (["--output-dir", "/dumps"], "--output-dir /dumps is applied only with --cuda-core-dump (this run: no "
                                 "--cuda-core-dump): add --cuda-core-dump, or drop --output-dir"),
])
def test_a_flag_for_a_part_the_run_does_not_start_is_refused(tiny_inputs, fake_loop, capsys, extra, message):
    argv, run_dir = tiny_inputs
    assert train_cmd.main(argv + extra + ["--dry-run"]) == 1
    assert f"k3 train: {message}" in capsys.readouterr().err
    assert train_cmd.main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists() and fake_loop[1] == []


def test_flags_left_at_their_defaults_are_not_refused(tiny_inputs, capsys):
    argv, _ = tiny_inputs
    resolved = resolve(train_cmd.parse_train_args(argv, environ={}))
    assert preflight.unused_flags(resolved) == []
    # the dump prints them off: nothing would apply them
    values = resolved.to_dict()
    assert (values["ref_load"], values["sglang_path"], values["output_dir"]) == (None, None, None)


def test_the_backend_must_fit_the_layout():
    # megatron's CUDA GPU is the loop's to check where the run starts (a dry run may run on a submit host)
    assert preflight.backend_problems(resolve(TrainArgs(model_variant="tiny", run_id="t", backend="megatron"))) == []
    torch_64 = resolve(TrainArgs(model_variant="full", run_id="t", num_nodes=16, num_gpus_per_node=4,
                                 pipeline_parallel_size=8, context_parallel_size=2, rollout_tp_size=16))
    assert preflight.backend_problems(torch_64) == [
        "--backend torch trains on one rank, but this layout has 64 training ranks (16 node(s) × 4 GPUs): add "
        "--backend megatron"]
    assert preflight.backend_problems(resolve(TrainArgs(model_variant="tiny", run_id="t"))) == []


def test_a_run_dir_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    assert preflight.run_dir_problem(tmp_path / "file" / "run") == (
        f"--run-dir {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is not a directory, so the run directory cannot "
        "be made there")
    assert preflight.run_dir_problem(tmp_path / "a" / "b") is None and not (tmp_path / "a").exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot be created: " in preflight.run_dir_problem(locked / "run")
    # The lock probe of a dry run reads through the same path without tripping on the file.
    assert holder_of(tmp_path / "file" / "run") is None
