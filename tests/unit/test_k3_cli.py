"""``python -m k3`` is the ``k3`` script: the same typer app, with every command registered.

Run as a user runs it (a subprocess from the repository root), so a command whose module fails to import shows up
here as "(unavailable: ...)" in the help instead of passing unnoticed. The ``torchrun ... -m k3 convert hf-to-dist``
form is tested in ``tests/parity/test_megatron_convert.py`` (two gloo ranks at TP2 x EP2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("make-checkpoint", "prepare-data", "train", "record-fla-tuning", "convert")
CONVERTERS = ("mxfp4-to-bf16", "hf-to-dist", "dist-to-hf")


def run_k3(*args: str) -> subprocess.CompletedProcess:
    """``python -m k3 ARGS`` from the repository root, this checkout's k3 first on the path, a wide terminal."""
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "k3", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_python_m_k3_help_exits_0_and_lists_every_command():
    proc = run_k3("--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    missing = [c for c in COMMANDS if c not in proc.stdout]
    assert not missing, f"not in `python -m k3 --help`: {missing}\n{proc.stdout}"
    assert "unavailable" not in proc.stdout, proc.stdout
    assert "python -m k3" in proc.stdout  # the usage line names the form that was run


def test_python_m_k3_convert_lists_every_converter():
    proc = run_k3("convert", "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(c in proc.stdout for c in CONVERTERS), proc.stdout


def test_python_m_k3_runs_the_k3_scripts_entry_point():
    import k3.__main__ as module_entry
    import k3.launch.cli as cli

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["k3"] == "k3.launch.cli:main"
    assert module_entry.main is cli.main


def test_an_unknown_command_is_a_usage_error_naming_it():
    proc = run_k3("no-such-command")
    assert proc.returncode == 2
    assert "No such command" in proc.stderr and "no-such-command" in proc.stderr
