"""Every printed key is a key in effect: ``k3.launch.resolved_keys`` ties each name of ``resolved_config.json`` /
``.txt`` to the code that applies it, and this test holds the registry to the code.

It fails when (a) a key is printed that the registry does not list (or the registry lists one never printed), (b) a
reader the registry names does not read its key (an attribute access ``.name`` that is not a method call, or a
keyword ``name=``, in that module's source, by ``ast``), (c) a settings field is neither printed (under its name or
the flag it comes from, with the same value) nor listed as not applied, or a field listed as not applied is read by
code; and when an informational key's pinned value, a key's off value under another backend or engine, or
docs/RESOLVED_KEYS.md drift from the registry.

``PENDING`` are keys whose wiring is in flight on other branches: they are registered with the reader they will
have, and their reader check is an xfail(strict) — it turns red the moment the wiring lands, and the key must
then leave ``PENDING``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest

from k3.launch.args import TrainArgs, resolve
from k3.launch.parser import parse_train_args
from k3.launch.resolved_keys import (FIELD_SOURCES, NOT_PRINTED, REGISTRY, condition_holds, registry_markdown,
                                     resolved_value)
from k3.settings.run import RunSettings

ROOT = Path(__file__).resolve().parents[2]

# Printed, registered with the reader they will have, and not read yet: wiring in flight (issue #22 items 3 and the
# colocation issue). Empty this set as each lands (its reader check then passes and the xfail turns red).
PENDING: set[str] = set()

_FULL = ("--mode normal --model-variant full --task dapo-math --num-nodes 16 --num-gpus-per-node 4 "
         "--pipeline-parallel-size 8 --context-parallel-size 2 --rollout-tp-size 16 --rollout-max-concurrency 8 "
         "--lora-rank 32 --lora-alpha 64 --eval-interval 10 --sglang-max-total-tokens 65536 --run-id r")
# Resolves that between them print every key, each only_with key both applied and off.
CASES = {
    "tiny": lambda: resolve(TrainArgs(model_variant="tiny", run_id="r", hf_checkpoint="/ckpt")),
    "tiny-normal-eval-coredump": lambda: resolve(TrainArgs(model_variant="tiny", run_id="r", mode="normal",
                                                           task="dapo-math", eval_interval=2, cuda_core_dump=True)),
    "4layer-megatron-sglang": lambda: resolve(TrainArgs(run_id="r", backend="megatron", rollout_engine="sglang")),
    "full-megatron-sglang": lambda: resolve(parse_train_args(
        (_FULL + " --backend megatron --rollout-engine sglang").split(), environ={})),
    "full-torch-embedded": lambda: resolve(parse_train_args(_FULL.split(), environ={})),
}


@functools.cache
def printed(case: str) -> dict[str, Any]:
    return CASES[case]().to_dict()


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse((ROOT / module).read_text(encoding="utf-8"), filename=module)


def reads(module: str, name: str) -> bool:
    """Whether ``module`` reads ``name``: an attribute ``.name`` loaded (not called as a method), a keyword
    ``name=``, or a function parameter ``name`` that its function uses (``build_megatron_policy(…, ref_load=None)``
    reading ``ref_load``)."""
    tree = _tree(module)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Load)
                and id(node) not in called):
            return True
        if isinstance(node, ast.keyword) and node.arg == name:
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            if any(arg.arg == name for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)) and any(
                    isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                    for stmt in node.body for n in ast.walk(stmt)):
                return True
    return False


def _k3_modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "k3").rglob("*.py"))


# --------------------------------------------------------------------------- (a) printed <-> registered
def test_every_printed_key_is_registered_and_every_registered_key_printed():
    seen = set().union(*(printed(case) for case in CASES))
    unregistered = sorted(seen - REGISTRY.keys())
    assert not unregistered, f"printed but not in k3/launch/resolved_keys.py REGISTRY: {unregistered}"
    stale = sorted(REGISTRY.keys() - seen)
    assert not stale, f"registered but never printed: {stale}"
    assert not (NOT_PRINTED.keys() & seen), "a NOT_PRINTED field is printed"


# --------------------------------------------------------------------------- (b) the readers read their key
def _reader_params():
    for name, entry in sorted(REGISTRY.items()):
        if entry.informational:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=f"{name}: wiring in flight; remove it from PENDING once it "
                                                        "lands")] if name in PENDING else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", _reader_params())
def test_each_named_reader_reads_its_key(name):
    entry = REGISTRY[name]
    assert entry.readers, f"{name}: an applied key names the code that applies it"
    for reader in entry.readers:
        assert (ROOT / reader.module).is_file(), f"{name}: reader {reader.module} does not exist"
        assert reads(reader.module, reader.name), (
            f"{name}: {reader.module} does not read .{reader.name} / {reader.name}= (the registry says it applies "
            "the key)")


def test_pending_keys_are_registered_applied_keys():
    for name in PENDING:
        assert name in REGISTRY and not REGISTRY[name].informational, name


def test_the_launcher_is_a_reader_only_of_flags_it_turns_into_other_keys():
    for name, entry in REGISTRY.items():
        if any(r.module == "k3/launch/args.py" for r in entry.readers):
            assert entry.becomes, f"{name}: k3/launch/args.py builds the settings; name the code that applies it"
        for key in entry.becomes:
            assert key in REGISTRY, f"{name} becomes {key}, which is not a registered key"
        if entry.becomes:
            assert any(not REGISTRY[key].informational for key in entry.becomes), (
                f"{name} becomes only keys nothing applies: {entry.becomes}")


def test_informational_keys_say_why_and_hold_their_pinned_value():
    for name, entry in REGISTRY.items():
        if not entry.informational:
            continue
        assert len(entry.informational) > 20, name
        if entry.pinned is None:
            continue
        for case in CASES:
            values = printed(case)
            want = entry.pinned(values) if callable(entry.pinned) else entry.pinned
            assert values[name] == want, f"{case}: {name} prints {values[name]!r}, but the code fixes {want!r}"


# --------------------------------------------------------------------------- (c) settings fields are printed
def _settings_fields(obj: Any, owner: str):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _settings_fields(value, type(value).__name__)
        else:
            yield f"{owner}.{f.name}", f.name, value


def _json(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return str(value) if isinstance(value, Path) else value


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_settings_field_is_printed_with_the_value_in_effect(case):
    resolved = CASES[case]()
    values = resolved.to_dict()
    assert isinstance(resolved.settings, RunSettings)
    for path, name, value in _settings_fields(resolved.settings, "RunSettings"):
        if path in FIELD_SOURCES:
            assert values[FIELD_SOURCES[path]] == _json(value), f"{path} != printed {FIELD_SOURCES[path]}"
        elif name in NOT_PRINTED:
            continue
        else:
            assert name in values, f"{path} is a setting the parts take, but it is not printed"
            assert values[name] == resolved_value(name, _json(value), values), f"{path}: printed {values[name]!r}"


def test_fields_left_unprinted_are_read_by_no_code():
    exempt = ("k3/settings/", "k3/launch/args.py", "k3/rollout/sglang/server_args.py")  # the last only rebuilds them
    for name in NOT_PRINTED:
        readers = [m for m in _k3_modules() if not m.startswith(exempt) and reads(m, name)]
        assert not readers, f"{name} is read by {readers}: print it (remove it from NOT_PRINTED) and register it"


def test_a_key_another_backend_or_engine_applies_prints_its_off_value():
    for name, entry in REGISTRY.items():
        if entry.only_with is None:
            continue
        states = {condition_holds(entry, printed(case)) for case in CASES}
        assert states == {True, False}, f"{name}: the cases should print it both applied and off"
        for case in CASES:
            values = printed(case)
            if not condition_holds(entry, values):
                assert values[name] == entry.off, (case, name)
    tiny, mega = printed("tiny"), printed("full-megatron-sglang")
    assert (tiny["recompute_granularity"], tiny["use_dynamic_batch_size"], tiny["sglang_path"]) == (None, False, None)
    assert (mega["recompute_granularity"], mega["use_dynamic_batch_size"]) == ("full", True)
    assert mega["sglang_max_total_tokens"] == 65536 and printed("full-torch-embedded")["sglang_max_total_tokens"] is None


# --------------------------------------------------------------------------- the docs table
def test_docs_table_is_generated_from_the_registry():
    path = ROOT / "docs" / "RESOLVED_KEYS.md"
    assert path.read_text(encoding="utf-8") == registry_markdown(), (
        "docs/RESOLVED_KEYS.md is stale: python -m k3.launch.resolved_keys > docs/RESOLVED_KEYS.md")
