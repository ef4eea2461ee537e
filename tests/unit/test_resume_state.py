"""``trainer_state.pt``: what it must hold (k3/rl/resume.py's docstring), loaded only with
``torch.load(weights_only=True)``. A planted pickle never runs its payload; a malformed or foreign state is refused
with one line naming the file and what is wrong; every state the trainers really save loads."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.rl.errors import TrainingError
from k3.rl.resume import (STATE_NAME, latest_checkpoint, load_checkpoint_state, load_trainer_state, save_checkpoint,
                          trainer_state_problem)
from k3.rl.trainers.group import merge_rank_states

GOOD = {"rollout_id": 1, "version": 2, "backend": "torch", "optimizer": {"state": {}, "param_groups": []},
        "steps": 2}


class _Planted:
    """Unpickles by running a shell command: the payload of a planted ``trainer_state.pt``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


class _NotPlainData:
    """An object a trainer state must never hold (it would need the unpickler to import and build a class)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A complete adapter checkpoint of the tiny model (adapter files + a good trainer state)."""
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import save_peft_adapter
    from k3.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=2, alpha=4))
    ckpt = tmp_path_factory.mktemp("run") / "adapters" / "rollout_000001"
    save_peft_adapter(model, ckpt)
    torch.save(GOOD, ckpt / STATE_NAME)
    return ckpt


def _with_state(checkpoint: Path, tmp_path: Path, state: object) -> Path:
    import shutil

    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    torch.save(state, copy / STATE_NAME)
    return copy


def test_a_planted_pickle_never_runs_its_payload(checkpoint, tmp_path):
    marker = tmp_path / "payload-ran"
    bad = _with_state(checkpoint, tmp_path, {**GOOD, "note": _Planted(marker)})
    # The plant is live: an unrestricted unpickler (what --resume used) runs it.
    armed = subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=False)",
                            str(bad / STATE_NAME)], capture_output=True, text=True, timeout=120)
    assert marker.exists(), armed.stderr
    marker.unlink()

    with pytest.raises(TrainingError) as err:
        load_checkpoint_state(bad)
    assert not marker.exists()
    message = str(err.value)
    assert f"checkpoint file {bad / STATE_NAME} is refused" in message and "system" in message
    assert "\n" not in message and "start a fresh --run-dir" in message


@pytest.mark.parametrize("state, says", [
    ({"rollout_id": 1, "version": 2, "steps": 2}, "no optimizer state in it (no 'optimizer' key)"),
    ({**GOOD, "optimizer": [{}, 2]}, "'optimizer' is a list, not an optimizer's state dict (or a list of them)"),
    ({**GOOD, "optimizer": "adam"}, "'optimizer' is a str, not an optimizer's state dict"),
    ({**GOOD, "steps": None}, "'steps' is None, not an integer >= 0"),
    ([GOOD], "it holds a list, not a dict"),
    ({"steps": 1}, "no rollout_id in it"),
    ({**GOOD, "rollout_id": "7"}, "rollout_id is '7', not an integer >= 0"),
    ({**GOOD, "version": -1}, "version is -1, not an integer >= 0"),
    ({**GOOD, "ranks": []}, "'ranks' is list, not a list of the ranks' optimizer states"),
    ({"rollout_id": 1, "version": 2, "ranks": [GOOD, {"steps": 1}]}, "no rank 1's optimizer state in it"),
    ({**GOOD, "optimizer": {"state": {0: _NotPlainData()}}}, "is refused: it holds a Python object"),
], ids=["no-optimizer", "optimizer-list-of-non-dicts", "optimizer-text", "no-steps", "not-a-dict", "no-rollout-id",
        "rollout-id-text", "negative-version", "empty-ranks", "rank-without-optimizer", "foreign-object"])
def test_a_malformed_state_is_refused_in_one_line_naming_the_file(checkpoint, tmp_path, state, says):
    bad = _with_state(checkpoint, tmp_path, state)
    with pytest.raises(TrainingError) as err:
        load_checkpoint_state(bad)
    message = str(err.value)
    assert message.startswith(f"checkpoint file {bad / STATE_NAME} ") and says in message, message
    assert "\n" not in message


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_bytes_that_are_no_torch_file_are_corrupted(tmp_path):
    path = tmp_path / STATE_NAME
    path.write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(TrainingError, match=r"trainer_state\.pt is corrupted \(not a torch file") as err:
        load_trainer_state(path)
    assert "\n" not in str(err.value)


def test_the_states_the_trainers_save_load_with_weights_only(tmp_path):
    """A real AdamW state after a step (tensors, tuples of betas, None and bool options) for one rank, and the
    merged state of two megatron ranks whose chained optimizer gives a list of such states, come back equal."""
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.98))
    p.grad = torch.ones_like(p)
    opt.step()
    one = {"backend": "torch", "optimizer": opt.state_dict(), "steps": 1}
    megatron = {"backend": "megatron", "parallel": [2, 1, 1, 1], "dp": 1, "steps": 1,
                "optimizer": [opt.state_dict(), opt.state_dict()]}
    for state in ({"rollout_id": 0, "version": 1, **one},
                  {"rollout_id": 3, "version": 4, **merge_rank_states([megatron, megatron])}):
        assert trainer_state_problem(state) is None
        torch.save(state, tmp_path / STATE_NAME)
        loaded = load_trainer_state(tmp_path / STATE_NAME)
        assert loaded.keys() == state.keys() and loaded["rollout_id"] == state["rollout_id"]
        states = [rank["optimizer"] for rank in loaded.get("ranks", [loaded])]
        for got in [o for state in states for o in (state if isinstance(state, list) else [state])]:
            assert got["param_groups"][0]["betas"] == (0.9, 0.98)
            assert torch.equal(got["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_save_whose_state_would_not_load_safely_fails_and_commits_nothing(checkpoint, tmp_path):
    """The save checks what it wrote the way --resume will read it: a state with a foreign object fails this save,
    not a later resume, and leaves no checkpoint behind; a plain one is committed and loads."""
    import shutil

    class Trainer:
        def __init__(self, optimizer_state: dict) -> None:
            self.state = optimizer_state

        def call(self, method, *args):
            if method == "save_adapter":
                shutil.copytree(checkpoint, args[0], ignore=shutil.ignore_patterns(STATE_NAME))
                return args[0]
            assert method == "optimizer_state"
            return self.state

    run = tmp_path / "run"
    foreign = {"backend": "torch", "optimizer": {"state": {0: _NotPlainData()}}, "steps": 1}
    with pytest.raises(TrainingError, match=r"is refused: it holds a Python object .*plain data and tensors") as err:
        save_checkpoint(run, Trainer(foreign), 0, 1)
    assert "_NotPlainData" in str(err.value) and "\n" not in str(err.value)
    assert latest_checkpoint(run) is None and not (run / "adapters" / "rollout_000000").exists()
    plain = {k: v for k, v in GOOD.items() if k not in ("rollout_id", "version")}
    assert save_checkpoint(run, Trainer(plain), 0, 1) == latest_checkpoint(run) == run / "adapters" / "rollout_000000"
    assert load_checkpoint_state(latest_checkpoint(run)) == {"rollout_id": 0, "version": 1, **plain}
