"""Flags of the recipe's launcher that k3 cannot honour are refused at parse time with a one-line reason, on the
command line and as their K3_* variable, and are never printed as if in effect (k3/launch/refused_flags.py)."""

from __future__ import annotations

import dataclasses

import pytest

from k3.launch import train as train_cmd
from k3.launch.args import LaunchConfigError, TrainArgs, resolve
from k3.launch.parser import build_parser, env_var_name, flag_name, parse_train_args
from k3.launch.refused_flags import REFUSED_FLAGS

REASONS = {  # the gist each reason must give
    "megatron_path": "installed megatron-core package",
    "megatron_model_type": "--hf-checkpoint's config.json",
    "extra_args": "no Megatron-LM argument parser",
    "save_dir": "the adapter checkpoints go to <run-dir>/adapters",
    "save_debug_rollout_data": "does not write the rollouts' samples",
    "update_weight_buffer_size": "never sends base weights to the engines",
}


def test_every_refused_flag_has_its_reason_checked_here():
    assert set(REFUSED_FLAGS) == set(REASONS)


@pytest.mark.parametrize("name", sorted(REFUSED_FLAGS))
def test_a_refused_flag_stops_the_parse_in_one_line(name, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        parse_train_args([flag_name(name), "x", "--run-dir", str(tmp_path / "run")], environ={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("k3 train: error:")]
    assert line == f"k3 train: error: {flag_name(name)} is not supported: {REFUSED_FLAGS[name]}"
    assert REASONS[name] in line
    # k3 train itself: nothing written.
    with pytest.raises(SystemExit):
        train_cmd.main([flag_name(name), "x", "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(REFUSED_FLAGS))
def test_a_refused_flag_is_refused_from_the_environment_too(name):
    with pytest.raises(LaunchConfigError, match=f"^{env_var_name(name)} is set, but {flag_name(name)} is not "
                                                "supported: .*; unset it$"):
        parse_train_args([], environ={env_var_name(name): "x"})


def test_refused_flags_are_no_setting_and_never_printed():
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    assert not fields & set(REFUSED_FLAGS)
    printed = resolve(TrainArgs(run_id="t")).to_dict()
    assert not printed.keys() & set(REFUSED_FLAGS)


def test_help_lists_each_refused_flag_with_its_reason(capsys):
    squeezed = "".join(build_parser({}).format_help().split())  # help wraps lines (and words at hyphens)
    assert "refused:flagsoftherecipe'slauncherthatk3cannothonour" in squeezed
    for name, why in REFUSED_FLAGS.items():
        assert "".join(f"{flag_name(name)} [VALUE ...] not supported: {why}".split()) in squeezed, name
