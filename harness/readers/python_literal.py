"""Parse the Python dict reprs the public recipe prints (``perf 3: {'perf/step_time': 712.4, …}``) — safely.

The text comes from a log, so it is data: it is parsed, never executed. :func:`ast.literal_eval` reads plain
literals. Two things in those dicts are not literals: non-finite floats print as ``nan`` / ``inf``, and NumPy
2 scalars print as ``np.float64(0.5)``. For those, and only those, the parser walks the syntax tree itself
and accepts exactly: the names ``nan`` / ``inf``, and one-argument calls of NumPy / builtin scalar types
whose argument is itself a literal. Anything else (a name, an attribute, another call) is an error.
"""

from __future__ import annotations

import ast
import math
from typing import Any

__all__ = ["LiteralError", "parse_dict_literal"]

_NUMBER_NAMES = {"nan": math.nan, "inf": math.inf}
# Scalar wrappers whose repr is `name(value)`; the value inside is a literal.
_SCALAR_TYPES = {
    f"{prefix}{name}"
    for prefix in ("np.", "numpy.")
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "bool_", "str_")
} | {"float", "int", "bool"}
_NUMPY_CONSTANTS = {"np.True_": True, "np.False_": False, "numpy.True_": True, "numpy.False_": False,
                    "np.nan": math.nan, "np.inf": math.inf}


class LiteralError(ValueError):
    """The text is not a dict literal of the accepted form."""


def parse_dict_literal(text: str) -> dict[str, Any]:
    """``"{'a': 1, 'b': np.float64(0.5)}"`` → ``{'a': 1, 'b': 0.5}``; raises :class:`LiteralError` otherwise."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = _walk_expression(text)
    if not isinstance(value, dict):
        raise LiteralError(f"expected a dict, got {type(value).__name__}")
    return value


def _walk_expression(text: str) -> Any:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise LiteralError(f"not a Python literal ({e.__class__.__name__}: {e}); truncated line?") from None
    return _value(tree.body)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise LiteralError("dict unpacking (**) is not a literal")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            raise LiteralError("a sign applies to numbers only")
        return -operand if isinstance(node.op, ast.USub) else operand
    name = _dotted(node)
    if name is not None:
        if name in _NUMBER_NAMES:
            return _NUMBER_NAMES[name]
        if name in _NUMPY_CONSTANTS:
            return _NUMPY_CONSTANTS[name]
        raise LiteralError(f"name {name!r} is not a literal")
    if isinstance(node, ast.Call):
        func = _dotted(node.func)
        if func in _SCALAR_TYPES and len(node.args) == 1 and not node.keywords:
            inner = _value(node.args[0])
            if func.endswith(("bool_", "bool")):
                return bool(inner)
            if func.endswith("str_"):
                return str(inner)
            return float(inner) if "float" in func else int(inner)
        raise LiteralError(f"call of {(func or ast.unparse(node.func))[:60]!r} is not a literal")
    raise LiteralError(f"{type(node).__name__} is not a literal")
