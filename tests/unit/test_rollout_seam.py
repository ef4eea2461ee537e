"""The rollout-engine seam: every engine registered once by name (k3/rollout/registry.py), the launcher and the
loop asking the registered engine instead of branching on its name, the registry cheap to import, and the
rollout part below rl."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3.launch.args import TrainArgs, resolve
from k3.launch.train import check_inputs
from k3.rl.engines import start_engines
from k3.rl.errors import TrainingError
from k3.rollout.errors import EngineUnavailableError
from k3.rollout.registry import DEFAULT_ENGINE, ENGINE_NAMES, ENGINES, engine_kind

REPO = Path(__file__).resolve().parents[2]


def test_the_engines_and_what_the_loop_and_launcher_know_of_them():
    assert ENGINE_NAMES == ("embedded", "sglang") and DEFAULT_ENGINE == "embedded"
    known = {name: (k.needs_gpus, k.holds_memory_at_start, k.shutdown_with_run, k.has_sabotage_hook)
             for name, k in ENGINES.items()}
    assert known == {"embedded": (False, False, False, True), "sglang": (True, True, True, False)}
    field = {f.name: f for f in dataclasses.fields(TrainArgs)}["rollout_engine"]
    assert field.default == DEFAULT_ENGINE and field.metadata["choices"] == ENGINE_NAMES
    assert field.metadata["help"] == "rollout engine: embedded (k3.model, any device) or sglang (GPU cluster)"


def test_an_unknown_engine_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="rollout engine 'vllm': expected one of embedded, sglang"):
        engine_kind("vllm")
    with pytest.raises(ValueError, match="--rollout-engine 'vllm': expected one of embedded, sglang"):
        resolve(TrainArgs(run_id="t", rollout_engine="vllm"))


def test_the_registry_imports_neither_torch_nor_an_engine():
    code = ("import sys, k3.rollout.registry; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'ray') "
            "or m.endswith(('.engine', '.worker', '.start'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sglang_inputs_and_availability_are_asked_of_the_engine(tmp_path):
    import importlib.util

    sglang = engine_kind("sglang")
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is importable here")
    args = SimpleNamespace(sglang_path=str(tmp_path / "nowhere"))
    assert sglang.input_problems(args) == [
        f"--sglang-path {tmp_path / 'nowhere'} has no sglang/ and sglang is not installed: install the `cluster` "
        "extra or pass --sglang-path DIR"]
    (tmp_path / "src" / "sglang").mkdir(parents=True)
    assert sglang.input_problems(SimpleNamespace(sglang_path=str(tmp_path / "src"))) == []
    with pytest.raises(EngineUnavailableError, match=r"needs sglang==0\.5\.23, which is not installed"):
        sglang.check_available(args, in_process=False)
    embedded = engine_kind("embedded")
    assert embedded.input_problems(args) == [] and embedded.check_available(args, in_process=True) is None
    assert (embedded.python_path(args), embedded.worker_env(args)) == ([], {})
    assert sglang.python_path(args) == [args.sglang_path] and sglang.worker_env(args)["SGLANG_JIT_ROUTE_RADIX"] == "1"
    resolved = resolve(TrainArgs(run_id="t", rollout_engine="sglang", sglang_path=args.sglang_path,
                                 hf_checkpoint=str(tmp_path), data_dir=str(tmp_path)))
    assert sglang.input_problems(args)[0] in check_inputs(resolved)


def test_the_broken_sync_hook_is_refused_on_an_engine_without_it():
    with pytest.raises(TrainingError, match=r"the broken-sync test hook \(K3_TEST_BREAK_ADAPTER_SYNC\) is the "
                                            "embedded engine's"):
        start_engines("sglang", None, None, None, None, None, sabotage_sync=True)
    with pytest.raises(ValueError, match="the broken-sync test hook is the embedded engine's"):
        engine_kind("sglang").start(None, None, None, None, None, sabotage_sync=True)


def test_rollout_imports_nothing_of_rl_or_launch():
    """rollout is below rl (the loop starts engines through the registry), and no part imports the launcher."""
    found = []
    for path in sorted((REPO / "k3" / "rollout").rglob("*.py")) + sorted((REPO / "k3" / "settings").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith(("k3.rl", "k3.launch"))]
    assert found == []
