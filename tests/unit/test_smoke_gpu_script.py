"""`make smoke-gpu` (ci/smoke_gpu.sh) as far as a machine without CUDA can check it.

Without CUDA the script stops at once with one line saying what is missing. What it would run on the GPU is
checked here too, so one device call is not spent on a typo: the ``k3 train`` flags it passes resolve with the
project's own parser (with and without the dance), the tokenizer it gives the synthetic 4layer checkpoint loads
through ``k3.tokenizer`` and speaks the chat format, and the ballast that shrinks the device refuses to run without
CUDA. The run itself is the device's (the gpu-marked ballast test, then `make smoke-gpu`).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint.synth import checkpoint_config, synthetic_config
from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.rl.data.chat import as_messages, assistant_prefix
from k3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "smoke_gpu.sh"
_spec = importlib.util.spec_from_file_location("smoke_gpu_tokenizer", ROOT / "ci" / "smoke_gpu_tokenizer.py")
smoke_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke_tokenizer)


def _cpu_env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMOKE_GPU", "K3_"))}
    return {**env, "K3_PYTHON": sys.executable, **extra}


# ------------------------------------------------------------------------------------------------ no CUDA
def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], env=_cpu_env(OUT=str(out)), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2
    assert len(lines) == 1, lines
    assert re.fullmatch(r"smoke-gpu: needs one CUDA GPU: .*python[0-9.]*: torch \S+ sees no CUDA device.*; "
                        r"nothing was started", lines[0]), lines[0]
    assert not out.exists()  # nothing was started, not even its log


def test_a_python_without_torch_is_named(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(SCRIPT)], env=_cpu_env(K3_PYTHON=str(fake)), capture_output=True, text=True,
                          timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"smoke-gpu: needs one CUDA GPU: {fake}: ModuleNotFoundError")


def test_the_old_fraction_variable_is_refused_not_ignored(tmp_path):
    """The budget is SMOKE_GPU_MEMORY_GIB now (the same bytes on any card); a user's old SMOKE_GPU_MEMORY_FRACTION
    stops the script before anything starts instead of being silently replaced. A fake python plays the GPU."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 79.2 GiB, torch 2.11.0+cu130'\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], env=_cpu_env(K3_PYTHON=str(fake), OUT=str(out),
                                                              SMOKE_GPU_MEMORY_FRACTION="0.25"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    # the script's output goes through tee: the pipe's EOF (which run() waits for) comes after tee's last write
    assert done.stdout.strip().splitlines()[-1] == (
        "smoke-gpu: SMOKE_GPU_MEMORY_FRACTION is gone: the budget is SMOKE_GPU_MEMORY_GIB (default 35), the same "
        "bytes on any card; nothing was started")
    assert not (out / "verdict.json").exists()


# ------------------------------------------------------------------------------------------------ where the inputs go
@pytest.mark.parametrize("ram_free, avail, kept, where", [
    (64, 120, 0, "ram"),  # a 128 GiB host: /dev/shm is half of it
    (43, 120, 0, "disk"),  # /dev/shm one GB short of the inputs + Ray's slack (28 + 16)
    (0, 120, 0, "disk"),  # a container's small /dev/shm
    (64, 67, 0, "disk"),  # the host one GB short of the inputs + the pinned backups and processes (28 + 40)
    (20, 44, 24, "ram"),  # an earlier run's inputs, kept in /dev/shm: reused, so their space counts
])
def test_the_inputs_go_in_ram_when_the_host_has_room(ram_free, avail, kept, where):
    done = subprocess.run(["bash", "-c", f'source ci/smoke_gpu_work.sh; smoke_gpu_work_dir 28 /dev/shm {ram_free} '
                          f'{avail} {kept} /tmp/k3-smoke-gpu'], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    work, why = done.stdout.rstrip("\n").split("\t")
    if where == "ram":
        assert work == "/dev/shm/k3-smoke-gpu"
        assert why == (f"in RAM: /dev/shm has {ram_free + kept} GB for the inputs' ~28 GB, the host {avail + kept} GB "
                       "available")
    else:
        assert work == "/tmp/k3-smoke-gpu"
        assert why == (f"on disk: /dev/shm has {ram_free + kept} GB (needs 44), the host {avail + kept} GB available "
                       "(needs 68)")


@pytest.mark.parametrize("work", [None, "mine"])
def test_the_script_says_where_the_inputs_go(tmp_path, work):
    """A fake python plays the GPU; the old fraction variable stops the script right after its settings."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 79.2 GiB, torch 2.11.0+cu130'\n")
    fake.chmod(0o755)
    extra = {"SMOKE_GPU_WORK": str(tmp_path / work)} if work else {"SMOKE_GPU_RAM_DIR": str(tmp_path)}
    env = _cpu_env(K3_PYTHON=str(fake), OUT=str(tmp_path / "out"), SMOKE_GPU_MEMORY_FRACTION="0.25", **extra)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    line = next(x for x in done.stdout.splitlines() if x.startswith("smoke-gpu: inputs and run in "))
    if work:
        assert line == f"smoke-gpu: inputs and run in {tmp_path / work} (SMOKE_GPU_WORK)"
    else:
        assert re.fullmatch(rf"smoke-gpu: inputs and run in ({re.escape(str(tmp_path))}/k3-smoke-gpu \(in RAM: "
                            rf"|/tmp/k3-smoke-gpu \(on disk: ){re.escape(str(tmp_path))} has \d+ GB.*\)", line), line


def test_make_smoke_gpu_runs_the_script(tmp_path):
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "smoke-gpu"], env=_cpu_env(OUT=str(tmp_path / "o")),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.splitlines()[0].startswith("smoke-gpu: needs one CUDA GPU: ")


# ------------------------------------------------------------------------------------------------ what it runs
def _train_args(**values: str) -> list[str]:
    """The script's TRAIN_ARGS with its variables filled in (the dance flags left out)."""
    text = SCRIPT.read_text()
    block = re.search(r"^TRAIN_ARGS=\($(.*?)^\)$", text, re.S | re.M).group(1)
    block = block.replace('"${DANCE_FLAGS[@]}"', "")
    block = re.sub(r'\$\(date [^)]*\)', "20260101", block)
    for name, value in values.items():
        block = block.replace(f'"${name}"', value).replace(f"${name}", value)
    assert "$" not in block, block
    return shlex.split(block)


VALUES = dict(ROLLOUTS="20", RESPONSE_LEN="512", BUDGET_GIB="35", WORK="/work", RUN="/run", PROFILE_STEP="1")


@pytest.fixture
def no_shim(monkeypatch):
    import k3.transport.shim as shim

    monkeypatch.setattr(shim, "shim_env", lambda env: {"LD_PRELOAD": "/shim.so"})


def test_the_train_flags_resolve_to_the_tier_s_configuration(no_shim):
    r = resolve(parse_train_args(_train_args(**VALUES), environ={}))
    d = r.to_dict()
    gpu_tier_lines = {"gpu_memory_gb_per_actor": 35.0, "gpu_memory_fraction_per_actor": None, "colocate_memory_peak_device": "gpu",
                      "lora_base_cpu_backup": True, "backend": "megatron", "rollout_engine": "embedded",
                      "rollout_max_response_len": 512, "offload_train": True, "num_gpus_per_node": 1}
    assert {k: d[k] for k in gpu_tier_lines} == gpu_tier_lines
    assert r.layout.world_size == 1
    assert (r.args.rollout_batch_size * r.args.n_samples_per_prompt, r.args.global_batch_size) == (64, 64)
    assert r.settings.training.num_steps_per_rollout == 1
    assert r.args.rollout_max_concurrency == 64  # one generation pass per rollout
    assert r.optimizer.optimizer == "adam" and r.args.eval_interval is None
    assert r.colocate.offload_rollout_level == ("kv_cache", "weight")
    assert r.settings.training.profile_train_step == 1  # the second step is profiled: its summary comes back


def test_without_the_dance_the_engine_releases_nothing(no_shim):
    argv = _train_args(**VALUES) + ["--no-lora-base-cpu-backup"]
    r = resolve(parse_train_args(argv, environ={"K3_OFFLOAD_ROLLOUT_LEVEL": ""}))
    assert r.colocate.offload_rollout_level == ()
    assert r.to_dict()["gpu_memory_gb_per_actor"] == 35.0  # the same cap
    text = SCRIPT.read_text()
    assert 'DANCE_FLAGS=(--no-offload-train --no-lora-base-cpu-backup)' in text
    assert 'export K3_OFFLOAD_ROLLOUT_LEVEL=""' in text


def test_the_script_judges_by_the_gpu_tier_and_writes_what_comes_back():
    text = SCRIPT.read_text()
    assert "harness.cli check \"$RUN\" --tier gpu --finished --json \"$OUT/verdict.json\"" in text
    assert "harness.cli report \"$RUN\" --tier gpu --finished --out \"$OUT/report.html\"" in text
    assert '--markdown "$OUT/summary.md"' in text
    # the device brings back at most 8 files of $OUT, 2 folders deep
    written = set(re.findall(r'\$OUT/([\w.${}]+)', text)) | {"metrics.jsonl", "resolved_config.txt"}
    assert written == {"smoke_gpu.log", "verdict.json", "summary.md", "report.html", "metrics.jsonl",
                       "resolved_config.txt", "train_step_${PROFILE_STEP}_rank0.txt",
                       "train_step_${MEMORY_STEP}_memory_rank0.txt"}
    assert "RUN=${SMOKE_GPU_RUN_DIR:-$WORK/run}" in text  # the run's own many files stay out of $OUT
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


# ------------------------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    (path / "config.json").write_text(json.dumps(checkpoint_config(synthetic_config("4layer", 8), "bf16")))
    assert smoke_tokenizer.main([str(path)]) == 0
    return path


def test_the_tokenizer_has_the_release_s_size_and_ids(checkpoint, capsys):
    tok = load_tokenizer(checkpoint)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (163840, 163584, 163586, 163839)
    assert tok.decode([tok.eos_id]) == END_OF_MSG
    for marker in (OPEN, SEP, CLOSE):
        assert len(tok.encode(marker)) == 1 and 163584 < tok.encode(marker)[0] < 163839
    assert tok.encode(OPEN, allow_special=False) == list(OPEN.encode())


def test_the_tokenizer_speaks_the_chat_format_and_decodes_any_id(checkpoint):
    tok = load_tokenizer(checkpoint)
    text = f"{OPEN}message role=\"user\"{SEP}What is 17 + 25? é{CLOSE}message{SEP}{END_OF_MSG}" + assistant_prefix()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.eos_id) == 1 and max(ids) < 163840
    assert tok.encode("17 + 25 = 42") == list(b"17 + 25 = 42")  # a byte a token
    rng = random.Random(0)
    sampled = [rng.randrange(163840) for _ in range(200)]
    assert "<|reserved_" in tok.decode(sampled)
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]


def test_the_tokenizer_refuses_a_config_without_the_ids(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000, "bos_token_id": 900}))
    assert smoke_tokenizer.main([str(tmp_path)]) == 1
    assert "eos_token_id is None, expected a non-negative integer" in capsys.readouterr().err
    assert smoke_tokenizer.main([str(tmp_path / "nowhere")]) == 1


# ------------------------------------------------------------------------------------------------ ballast
def test_the_ballast_needs_cuda():
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "gpu_ballast.py"), "--leave-gib", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == "gpu_ballast: no CUDA device"


@pytest.mark.gpu
def test_the_ballast_leaves_the_budget_free_until_stopped():
    import signal
    import time

    import torch

    free0, _ = torch.cuda.mem_get_info(0)
    leave = max(1.0, free0 / 2**30 - 8.0)  # hold ~8 GiB
    proc = subprocess.Popen([sys.executable, str(ROOT / "ci" / "gpu_ballast.py"), "--leave-gib", f"{leave:.1f}"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("gpu_ballast: holding "), line
        free, _ = torch.cuda.mem_get_info(0)
        assert abs(free / 2**30 - leave) < 1.0  # what is left: the budget (± the ballast's own context)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    time.sleep(1.0)
    assert torch.cuda.mem_get_info(0)[0] > free0 - 2**30
