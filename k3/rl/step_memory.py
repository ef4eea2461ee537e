"""What one training step leaves allocated on the device (``--profile-train-step N``: step N + 1's, beside step N's
time profile).

A sleeping trainer pauses its torch_memory_saver regions; what stays on the device is the caching allocator's own
pool (``k3.transport.device_memory.default_pool_usage``). The first H100 smoke-gpu runs kept 1.44–1.46 GB there
after a training step and 0.08 GB before any: 0.57 GB of live blocks the size of a ``[tokens, 7168]`` BF16
activation, in 1.39 GB of segments those blocks keep from being returned. The readings say how much; this says
who holds it.

After the step (garbage collected first), the largest live blocks of the default pool are matched with the CUDA
tensors Python can reach (and their ``.grad``): a block holding one is charged to that tensor's holder, read from
the garbage collector's referrers (``Policy.attr``, ``Module._buffers['name']``, ``Adam.state[Parameter]['exp_avg']``,
a list). A block no reachable tensor lies in is held where Python cannot name it: a running function's local, an
autograd graph something still references, a C++ or library cache. Blocks that were not live before the step are
counted as the step's.

The 0.57 GB turned out to be the last micro-batch's activations, held through megatron's token dispatcher
(``k3.megatron.moe.release_dispatch_state``), found on CPU by watching layer inputs through weak references and
counting the autograd contexts still alive after a step. With that released, the H100's step 2 left 106 MiB live:
64 MiB in two blocks no Python object names, the rest the optimizer's main parameters and Adam state; the sleeping
trainer kept at most 0.26 GB.

Not the allocator's recorded history: on the H100 (torch 2.11), recording it with Python stacks made an autograd
Function's ``apply`` inside the training step return NULL without an exception (SystemError), with or without
``torch.profiler`` running.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from k3.transport.device_memory import DEFAULT_POOL

__all__ = ["LOOKED_UP", "LOOKUP_STOPPED", "NOT_LOOKED_UP", "OUTSIDE_PYTHON", "TensorView", "holder_of",
           "left_allocated", "left_allocated_text", "live_blocks", "reachable_tensors", "record_step_memory",
           "write_step_memory"]

T = TypeVar("T")
SHOWN = 12  # holders listed, most bytes first
LOOKED_UP = 16  # the largest live blocks whose holders are looked up (each lookup scans every Python object)
NOT_LOOKED_UP = f"(smaller than the {LOOKED_UP} largest blocks: holder not looked up)"
LOOKUP_BUDGET_S = 60.0  # seconds of holder lookups after a step, at most
LOOKUP_STOPPED = "(holder not looked up: the lookups' time budget was spent)"
MB = 2**20
# No Python object holds it that the garbage collector sees: a running function's local (its frame is not an
# object), an autograd graph something still references, a C++ or library cache.
OUTSIDE_PYTHON = "(no holder Python can name: a running function's local, an autograd graph, a C++ cache)"


@dataclass(frozen=True)
class TensorView:
    """A tensor's storage as the allocator sees it: ``[ptr, ptr + nbytes)``, who holds it and what it is."""

    ptr: int
    nbytes: int
    holder: str
    what: str  # shape and dtype, e.g. "[3533, 7168] bfloat16"


def live_blocks(snapshot: dict[str, Any], device_index: int = 0) -> tuple[list[tuple[int, int]], int]:
    """Of ``torch.cuda.memory._snapshot()`` output: the default pool's live blocks on ``device_index`` as
    ``(address, size)`` (bytes), and the bytes of the default pool's segments. A block without its own address is
    placed after the ones before it in its segment (the snapshot lists a segment's blocks in address order)."""
    blocks, reserved = [], 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", 0) != device_index or tuple(seg.get("segment_pool_id", DEFAULT_POOL)) != DEFAULT_POOL:
            continue
        reserved += int(seg["total_size"])
        at = int(seg.get("address", 0))
        for b in seg["blocks"]:
            address = int(b.get("address", at))
            if b["state"] == "active_allocated":
                blocks.append((address, int(b["size"])))
            at = address + int(b["size"])
    return blocks, reserved


def left_allocated(blocks: list[tuple[int, int]], reserved: int, tensors: Iterable[TensorView],
                   before: set[int] | None = None, looked_up: set[int] | None = None) -> dict[str, Any]:
    """The default pool's live ``blocks`` (:func:`live_blocks`) charged to the ``tensors`` whose storage starts in
    them (the first such tensor's holder; none: :data:`OUTSIDE_PYTHON`). ``before``: the addresses of the blocks
    live before the step; ``looked_up``: the addresses of the blocks whose tensors were searched (None: all), the
    others :data:`NOT_LOOKED_UP` unless a tensor is found in them. Sizes in MiB: ``{"reserved_mb", "live_mb",
    "made_in_step_mb", "made_in_step_blocks", "by_holder": [{"holder", "what", "mb", "blocks", "largest_mb",
    "in_step_mb"}, ...]}``, most bytes first, at most :data:`SHOWN` rows (the rest summed as
    ``"(other holders)"``)."""
    ordered = sorted(blocks)
    starts = [a for a, _ in ordered]
    owner: dict[int, TensorView] = {}
    for view in sorted(tensors, key=lambda v: (v.ptr, v.holder)):
        i = _block_index(starts, view.ptr)
        if i is not None and view.ptr < ordered[i][0] + ordered[i][1]:
            owner.setdefault(ordered[i][0], view)
    before = set() if before is None else before
    groups: dict[tuple[str, str], list[tuple[int, bool]]] = {}
    for address, size in ordered:
        view = owner.get(address)
        unknown = OUTSIDE_PYTHON if looked_up is None or address in looked_up else NOT_LOOKED_UP
        key = (view.holder, view.what) if view else (unknown, "")
        groups.setdefault(key, []).append((size, address not in before))
    rows = [{"holder": h, "what": w, "mb": sum(s for s, _ in g) / MB, "blocks": len(g),
             "largest_mb": max(s for s, _ in g) / MB, "in_step_mb": sum(s for s, new in g if new) / MB}
            for (h, w), g in groups.items()]
    rows.sort(key=lambda r: (-r["mb"], r["holder"], r["what"]))
    if len(rows) > SHOWN:
        rest = rows[SHOWN - 1:]
        rows = rows[:SHOWN - 1] + [{"holder": "(other holders)", "what": "", "mb": sum(r["mb"] for r in rest),
                                    "blocks": sum(r["blocks"] for r in rest),
                                    "largest_mb": max(r["largest_mb"] for r in rest),
                                    "in_step_mb": sum(r["in_step_mb"] for r in rest)}]
    made = [size for address, size in ordered if address not in before]
    return {"reserved_mb": reserved / MB, "live_mb": sum(s for _, s in ordered) / MB,
            "made_in_step_mb": sum(made) / MB, "made_in_step_blocks": len(made), "by_holder": rows}


def _block_index(starts: list[int], ptr: int) -> int | None:
    """Index of the last block starting at or below ``ptr`` (``starts`` ascending)."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= ptr:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1 if lo else None


def holder_of(t: torch.Tensor, ignore: Iterable[Any] = ()) -> str:
    """Who references ``t``, by the garbage collector's referrers: ``Class.attr``, ``Class.attr['key']`` for a
    dict attribute (as a module's ``_buffers``), ``Class.attr[Parameter]['key']`` one dict deeper (as an
    optimizer's ``state``), ``module m.name``, ``dict['key']``; failing those, a frame (``frame f (file:line)``)
    or closure cell, a container (``list of N``, ``set of N``, an object's type), a dict keyed by ``t``
    (``Class.attr (a key)``); :data:`OUTSIDE_PYTHON` when Python holds it nowhere. Objects in ``ignore`` (the
    caller's own lists) and this module's frames are not holders."""
    skip = {id(o) for o in ignore}
    # Named only when nothing holds t as a value or attribute: (preference, text), lower preferred.
    fallback: list[tuple[int, str]] = []
    for r in gc.get_referrers(t):
        if id(r) in skip or (isinstance(r, types.FrameType) and r.f_code.co_filename == __file__):
            continue
        if isinstance(r, dict):
            key = _key_of(r, t)
            if key is not AS_KEY:
                return _dict_holder(r, key, skip)
            if not any(rank == 2 for rank, _ in fallback):  # each such name costs scans: the first one only
                fallback.append((2, _dict_holder(r, key, skip)))
        elif isinstance(r, (list, tuple, set, frozenset)):
            fallback.append((1, f"{type(r).__name__} of {len(r)}"))
        elif isinstance(r, types.FrameType):
            fallback.append((0, f"frame {r.f_code.co_name} ({r.f_code.co_filename.rsplit('/', 2)[-1]}:{r.f_lineno})"))
        elif isinstance(r, types.CellType):
            fallback.append((0, "closure cell"))
        else:
            attrs = getattr(r, "__dict__", None)  # an instance whose attributes Python keeps inline
            key = _key_of(attrs, t) if isinstance(attrs, dict) else None
            if key is not None and key is not AS_KEY:
                return f"{_name(r)}.{key}"
            fallback.append((1, _name(r)))  # it holds t, but not by an attribute Python can name
    return min(fallback, key=lambda f: f[0])[1] if fallback else OUTSIDE_PYTHON


AS_KEY = object()  # :func:`_key_of`: the value is one of the mapping's keys


def _key_of(mapping: dict, value: Any) -> Any:
    """The key under which ``mapping`` holds ``value`` itself, :data:`AS_KEY` if ``value`` is a key, else None. (A
    plain loop: a generator over ``value`` would hold it in a closure cell, which :func:`holder_of` would then
    find as a holder.)"""
    for k, v in mapping.items():
        if v is value:
            return k
    for k in mapping:
        if k is value:
            return AS_KEY
    return None


def _name(obj: Any) -> str:
    return f"module {obj.__name__}" if isinstance(obj, types.ModuleType) else type(obj).__qualname__


def _item(key: Any) -> str:
    """``['key']`` for a key a person can read; ``[Parameter]`` (its type) for an object key; `` (a key)``."""
    if key is AS_KEY:
        return " (a key)"
    return f"[{key!r}]" if isinstance(key, (str, int)) or key is None else f"[{type(key).__name__}]"


def _dict_holder(d: dict, key: Any, skip: set[int]) -> str:
    """``d[key]`` named by what holds ``d``: an object whose ``__dict__`` it is (``Class.key``) or whose attribute it
    is (``Class.attr[key]``), one dict deeper (``Class.attr[k][key]``), or a module's globals."""
    if isinstance(d.get("__name__"), str) and getattr(sys.modules.get(d["__name__"]), "__dict__", None) is d:
        return f"module {d['__name__']}.{key}" if key is not AS_KEY else f"module {d['__name__']}{_item(key)}"
    for owner in gc.get_referrers(d):
        if id(owner) in skip or isinstance(owner, types.FrameType):
            continue
        if getattr(owner, "__dict__", None) is d:
            return f"{_name(owner)}.{key}" if key is not AS_KEY else f"{_name(owner)}{_item(key)}"
        named = _attribute(owner, d)
        if named is not None:
            return f"{named}{_item(key)}"
        if isinstance(owner, dict):  # one dict deeper: owner maps something to d
            inner = _key_of(owner, d)
            for obj in gc.get_referrers(owner):
                if id(obj) in skip or isinstance(obj, types.FrameType):
                    continue
                if getattr(obj, "__dict__", None) is owner and isinstance(inner, str):  # d is obj's attribute
                    return f"{_name(obj)}.{inner}{_item(key)}"
                outer = _attribute(obj, owner)
                if outer is not None:
                    return f"{outer}{_item(inner)}{_item(key)}"
    return f"dict{_item(key)}"


def _attribute(obj: Any, d: dict) -> str | None:
    """``Class.attr`` if ``d`` is one of ``obj``'s attributes, else None."""
    attrs = getattr(obj, "__dict__", None)
    attr = _key_of(attrs, d) if isinstance(attrs, dict) and attrs is not d else None
    return None if attr is None or attr is AS_KEY else f"{_name(obj)}.{attr}"


def reachable_tensors(device: torch.device | str, within: list[tuple[int, int]] | None = None,
                      budget_s: float = LOOKUP_BUDGET_S) -> list[TensorView]:
    """One tensor per allocation on ``device`` that the garbage collector can reach (a tensor or the ``.grad`` of
    one): its storage, holder (:func:`holder_of`) and shape. ``within``: only allocations inside these ``(address,
    size)`` blocks, one tensor per block (None: one per storage). A block's tensor is the first found that is not
    a view of another, else the first found. Each holder lookup scans every Python object, so they stop after
    ``budget_s`` seconds; the tensors left are named :data:`LOOKUP_STOPPED`."""
    device = torch.device(device)
    blocks = sorted(within) if within is not None else None
    starts = [a for a, _ in blocks] if blocks is not None else []

    def block_of(t: torch.Tensor) -> int | None:
        ptr = t.untyped_storage().data_ptr()
        if blocks is None:
            return ptr
        i = _block_index(starts, ptr)
        return blocks[i][0] if i is not None and ptr < blocks[i][0] + blocks[i][1] else None

    # type(), not isinstance: isinstance reads __class__, which some deprecated module proxies warn on
    found: list[torch.Tensor] = [obj for obj in gc.get_objects()
                                 if issubclass(type(obj), torch.Tensor) and obj.device == device]
    grads = {id(t.grad) for t in found if t.is_leaf and t.grad is not None}  # taken below as their owner's
    chosen: dict[int, list] = {}  # block -> [tensor, its owner (itself, or the tensor whose .grad it is), suffix]
    for t in found:
        if id(t) in grads:
            continue
        grad = t.grad if t.is_leaf else None  # a non-leaf's .grad is None and warns when read
        for tensor, suffix in ((t, ""), (grad, ".grad")):
            if tensor is None or tensor.device != device:
                continue
            block = block_of(tensor)
            if block is None:
                continue
            best = chosen.get(block)
            if best is None or (best[0]._base is not None and tensor._base is None):
                chosen[block] = [tensor, t, suffix]
    views = []
    ours = [found, *chosen.values()]
    deadline = time.monotonic() + budget_s
    for tensor, owner, suffix in chosen.values():
        holder = holder_of(owner, ignore=ours) + suffix if time.monotonic() < deadline else LOOKUP_STOPPED
        views.append(_view(tensor, holder))
    return views


def _view(t: torch.Tensor, holder: str) -> TensorView:
    storage = t.untyped_storage()
    return TensorView(storage.data_ptr(), storage.nbytes(), holder,
                      f"[{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')}")


def record_step_memory(fn: Callable[[], T]) -> tuple[T, dict[str, Any] | None]:
    """``fn()``, then :func:`left_allocated` of the current CUDA device (garbage collected first, so only what is
    still referenced counts); None for the second on a machine without CUDA. A diagnostic never fails the step:
    if the allocator cannot be read, the second is ``{"error": "..."}`` and the step's result stands."""
    if not torch.cuda.is_available():
        return fn(), None
    try:
        device = torch.cuda.current_device()
        before = {a for a, _ in live_blocks(torch.cuda.memory._snapshot(), device)[0]}
    except Exception as e:  # noqa: BLE001 - see the docstring
        return fn(), {"error": f"the allocator could not be read: {type(e).__name__}: {e}"}
    result = fn()
    try:
        torch.cuda.synchronize()
        gc.collect()
        blocks, reserved = live_blocks(torch.cuda.memory._snapshot(), device)
        largest = sorted(blocks, key=lambda b: -b[1])[:LOOKED_UP]
        found = left_allocated(blocks, reserved, reachable_tensors(torch.device("cuda", device), largest), before,
                               looked_up={a for a, _ in largest})
    except Exception as e:  # noqa: BLE001 - see the docstring
        found = {"error": f"the allocator could not be read: {type(e).__name__}: {e}"}
    return result, found


def left_allocated_text(found: dict[str, Any]) -> str:
    """:func:`left_allocated` output as lines a person reads."""
    if "by_holder" not in found:
        return f"left allocated in the default pool after the step: not recorded ({found.get('error', 'no data')})\n"
    lines = [f"left allocated in the default pool after the step: {found['live_mb']:.1f} MiB live in "
             f"{found['reserved_mb']:.1f} MiB of segments; {found['made_in_step_mb']:.1f} MiB in "
             f"{found['made_in_step_blocks']} blocks made during the step. By who holds them:", "",
             f"{'MiB':>10} {'in step':>8} {'blocks':>7} {'largest':>9}  holder: first tensor"]
    lines += [f"{r['mb']:10.1f} {r['in_step_mb']:8.1f} {r['blocks']:7d} {r['largest_mb']:9.1f}  {r['holder']}"
              + (f": {r['what']}" if r["what"] else "") for r in found["by_holder"]]
    return "\n".join(lines) + "\n"


def write_step_memory(found: dict[str, Any], folder: Path, name: str, title: str) -> Path:
    """Write :func:`left_allocated` output (or its ``{"error"}``) to ``<folder>/<name>.json`` and ``.txt``, the text
    headed by ``title``; returns the text file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(found, indent=1) + "\n")
    text = folder / f"{name}.txt"
    text.write_text(f"{title}\n\n{left_allocated_text(found)}")
    return text
