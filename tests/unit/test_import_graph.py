"""The house rules of docs/ARCHITECTURE.md, checked on the source: parts import downward only.

The graph is read from the source with ``ast`` (every ``import`` statement, function-local ones included), so a
lazy import cannot hide an upward arrow. A *part* is a top-level module or package of ``k3`` (``k3.model``,
``k3.rl``, ``k3.config``, …) or ``harness``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("k3", "harness")

# The order the parts stand in, bottom first: a part may import only parts listed before it. Two parts on one
# line are peers and import neither each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("k3.config",),
    ("k3.settings",),
    ("k3.kernels",),
    ("k3.checkpoint",),
    ("k3.model", "k3.tokenizer"),
    ("k3.transport",),
    ("k3.lora",),
    ("k3.rollout", "k3.megatron"),
    ("k3.rl",),
    ("k3.launch",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str | None:
    """``k3.rl.loop`` -> ``k3.rl``; ``k3.__main__`` is the launcher's entry point; outside k3/harness: None."""
    pieces = module.split(".")
    if pieces[0] == "harness":
        return "harness"
    if pieces[0] != "k3":
        return None
    if len(pieces) == 1:
        return "k3"
    return "k3.launch" if pieces[1] == "__main__" else f"k3.{pieces[1]}"


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports() -> list[tuple[str, str, str | None, str]]:
    """Every import in k3/ and harness/: ``(importing module, imported module, imported name or None, file:line)``."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    out += [(module, alias.name, None, where) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    target = _resolve(module, path.name == "__init__.py", node)
                    out += [(module, target, alias.name, where) for alias in node.names]
    return out


IMPORTS = _imports()


def _part_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, dst, _, where in IMPORTS:
        a, b = _part(src), _part(dst)
        if a and b and a != b:
            edges[(a, b)].append(where)
    return edges


def _find_cycle(nodes: set[str], edges: set[tuple[str, str]]) -> list[str] | None:
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(succ[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_every_part_is_placed_in_a_layer():
    placed = {p for layer in LAYERS for p in layer}
    parts = {_part(m) for m, *_ in IMPORTS} - {"harness", "k3"}
    assert parts <= placed, f"place the new parts in LAYERS (docs/ARCHITECTURE.md): {sorted(parts - placed)}"


def test_no_cycle_between_parts():
    edges = set(_part_edges())
    nodes = {n for e in edges for n in e}
    cycle = _find_cycle(nodes, edges)
    assert cycle is None, "import cycle between parts: " + " -> ".join(cycle or [])


def test_no_cycle_between_modules():
    edges = {(src, dst) for src, dst, _, _ in IMPORTS if _part(dst) and src != dst}
    # ``from k3.x import y`` where y is a submodule is an import of k3.x.y: a package's __init__ is not a cycle.
    modules = {m for m, *_ in IMPORTS}
    edges = {(a, b) for a, b in edges if b in modules and not a.startswith(b + ".")}
    cycle = _find_cycle({n for e in edges for n in e}, edges)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle or [])


def test_parts_import_downward_only():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    upward = [f"{a} -> {b} ({wheres[0]})" for (a, b), wheres in _part_edges().items()
              if a in rank and b in rank and rank[b] >= rank[a]]
    assert not upward, "imports that go up or sideways:\n" + "\n".join(sorted(upward))


def test_no_part_imports_the_launcher():
    offenders = [f"{a} ({wheres[0]})" for (a, b), wheres in _part_edges().items() if b == "k3.launch"]
    assert not offenders, "only the launcher may import k3.launch: " + ", ".join(sorted(offenders))


def test_harness_imports_nothing_of_k3():
    offenders = [where for src, dst, _, where in IMPORTS if src.startswith("harness") and _part(dst) not in
                 (None, "harness")]
    assert not offenders, "the harness judges k3 from its files and never imports it: " + ", ".join(offenders)


def test_kernels_are_leaves():
    offenders = [where for src, dst, _, where in IMPORTS if _part(src) == "k3.kernels" and
                 _part(dst) not in (None, "k3.kernels")]
    assert not offenders, "kernels import nothing else of k3: " + ", ".join(offenders)


@pytest.mark.parametrize("forbidden", ["k3.rl", "k3.lora", "k3.rollout", "k3.megatron", "k3.transport"])
def test_the_model_knows_no_rl_or_lora(forbidden):
    offenders = [where for src, dst, _, where in IMPORTS if _part(src) == "k3.model" and _part(dst) == forbidden]
    assert not offenders, f"k3.model imports {forbidden}: " + ", ".join(offenders)


def test_no_private_name_of_another_part():
    offenders = [f"{where}: {name} from {dst}" for src, dst, name, where in IMPORTS
                 if name and name.startswith("_") and not name.startswith("__") and _part(dst)
                 and _part(dst) != _part(src)]
    assert not offenders, "imports of another part's private names:\n" + "\n".join(offenders)


def test_the_graph_is_read():
    """The checks above would pass on an empty graph: make sure the reader finds the imports it must."""
    pairs = {(_part(s), _part(d)) for s, d, _, _ in IMPORTS}
    assert ("k3.rl", "k3.model") in pairs or ("k3.rl", "k3.lora") in pairs
    assert ("k3.launch", "k3.rl") in pairs
    assert len(IMPORTS) > 500
