"""Pinned fla autotune results: tune fla's KDA kernels once per GPU model, reuse the choice on every host.

fla 0.6.0 autotunes each Triton kernel the first time it meets a new key (head count, head dims, chunk size,
dtypes), and compiles every candidate config to do so, one after the other. On an H200 that costs 82 s for
the tiny model's first forward and another 151 s for its first backward (``ci/gpu_fla_probe.py``,
docs/PERFORMANCE.md); the second calls take 2 and 4 ms. A fresh host pays it again, so a short GPU job
spends most of its time choosing configs.

fla can read the choice from JSON files instead (``fla/ops/utils/cache.py``: ``FLA_CONFIG_DIR`` holds
``{kernel}.json`` with ``autotune_entries`` keyed by the md5 of Triton's tuning key; ``FLA_CACHE_MODE`` says how
to look them up). This module

- records: turns Triton's ``TRITON_PRINT_AUTOTUNING=1`` output into such files
  (``write_config_dir``, which ``k3 record-fla-tuning LOG... --out DIR`` runs), merging with the files already
  there;
- pins: before fla is first imported, points fla at the files shipped in ``k3/kernels/kda/fla_tuned/<GPU>/``
  for this GPU in ``strict`` mode: only an exact key (same kernel, shapes class and dtypes) reuses a recorded
  config; every other key is autotuned as before. A GPU with no folder of its own takes the folder of a GPU of
  the same compute capability (``compute_capability`` in the folder's manifest): a config is block shapes, warps
  and pipeline stages, and what those can use (shared memory per block, registers per thread) is fixed by the
  capability — an H100 and an H200 are both 9.0 with 227 KiB of shared memory per block — so the H200's choices
  run on an H100 and spare a fresh host minutes of autotuning; they may not be the H100's fastest (its memory is
  slower). Nothing is pinned when the user set ``FLA_CONFIG_DIR`` or ``FLA_CACHE_MODE`` (theirs wins), when
  ``K3_FLA_PINNED_CONFIGS=0``, when no files were recorded for this GPU or its capability, or when the installed
  fla-core is not the version they were recorded with. The shipped folder is the H200's, except 22 keys met
  only by the packed parity check's wide slice (float32, 8 heads of 128; and two BF16 ones), which were
  autotuned on an H100 (same capability) because no H200 was lent: valid on both, not tuned for the H200.

Where only the numbers matter (the GPU parity tests' workers, ``ci/gpu_megatron.sh``),
``K3_FLA_PINNED_CONFIGS=cover`` pins the same folder and widens the lookup (:func:`use_covering_configs`): a key
recorded nowhere takes the config of the narrowest recorded key that covers it (the same kernel, flags and dtypes,
every head count, head dim and chunk size at least as large), since a config that fits a wider shape fits a
narrower one; only a key nothing covers is autotuned. On a fresh host each autotuned key costs ~16 s per kernel on
an H100 (the tiny model's packed backward, measured), and a parity worker meets dozens. fla's own full mode is not
used: it takes the first entry of the same structure whatever its numbers, and handed a key of a wide slice the
tiny model's config, which needs more shared memory than a Hopper block has (Triton ``OutOfResources``, 237,568 >
232,448 bytes, measured on an H100).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PINNED_MODES", "SHIPPED", "TunedConfig", "covering_entry", "covers", "fla_config_env", "gpu_dir_name",
           "key_hash", "parse_autotune_log", "pin_fla_configs", "pinned_mode", "recorded_folder",
           "use_covering_configs", "write_config_dir"]

SHIPPED = Path(__file__).with_name("fla_tuned")
MANIFEST = "manifest.json"  # not a kernel name: fla only opens {kernel}.json for kernels it runs
_LAUNCH_FIELDS = ("num_warps", "num_ctas", "num_stages", "maxnreg")

_BLOCK = re.compile(
    r"Triton autotuning for function (?P<kernel>\w+),\s*\n"
    r"with key as (?P<key>\(.*\)),\s*\n"
    r"finished after [0-9.]+s,\s*\n"
    r"best config selected: (?P<config>[^;\n]*);")


@dataclass(frozen=True)
class TunedConfig:
    """One autotune result: the kernel, Triton's tuning key, and the config it chose."""

    kernel: str
    key: tuple
    kwargs: dict[str, Any] = field(hash=False)
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    maxnreg: int | None = None

    def as_fla_config(self) -> dict[str, Any]:
        """The ``config`` field fla reads (``CachedAutotuner.maybe_load_cached_config``)."""
        return {"kwargs": dict(self.kwargs), "num_warps": self.num_warps, "num_stages": self.num_stages,
                "num_ctas": self.num_ctas, "maxnreg": self.maxnreg}


def key_hash(key: tuple | list) -> str:
    """fla's entry id for a tuning key: md5 of its compact, key-sorted JSON (``AutotuneKey.key_hash``)."""
    return hashlib.md5(json.dumps(list(key), separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _parse_config(text: str, where: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        if not sep:
            raise ValueError(f"{where}: config {text!r}: expected 'name: value' pairs")
        fields[name.strip()] = ast.literal_eval(value.strip())
    missing = [f for f in ("num_warps", "num_stages") if f not in fields]
    if missing:
        raise ValueError(f"{where}: config {text!r} has no {', '.join(missing)}")
    return fields


def parse_autotune_log(text: str, source: str = "log") -> list[TunedConfig]:
    """Every ``Triton autotuning for function ...`` block of a log, in order (Triton 3.x's format).

    Args:
        text: what a process printed with ``TRITON_PRINT_AUTOTUNING=1`` (other lines are skipped).
        source: a name for error messages.

    Raises:
        ValueError: a block whose key or config cannot be read.
    """
    found = []
    for m in _BLOCK.finditer(text):
        where = f"{source}: {m['kernel']}"
        try:
            key = ast.literal_eval(m["key"])
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{where}: tuning key {m['key'][:80]!r} is not a Python literal ({e})") from None
        if not isinstance(key, tuple):
            raise ValueError(f"{where}: tuning key {m['key'][:80]!r}: expected a tuple")
        fields = _parse_config(m["config"], where)
        launch = {f: fields.pop(f) for f in _LAUNCH_FIELDS if f in fields}
        found.append(TunedConfig(m["kernel"], key, fields, **launch))
    return found


def _shape_scale(key: Any) -> int:
    """The sum of a tuning key's integers (head counts, head dims, chunk sizes; flags and dtypes left out)."""
    if isinstance(key, (list, tuple)):
        return sum(_shape_scale(v) for v in key)
    return key if isinstance(key, int) and not isinstance(key, bool) else 0


def write_config_dir(configs: list[TunedConfig], out_dir: Path, versions: dict[str, str] | None = None
                     ) -> list[Path]:
    """Write (or merge into) fla's ``{kernel}.json`` files under ``out_dir``; a later result for the same key
    replaces an earlier one; entries go widest shapes first, and the first is also the ``default_config``.
    ``versions`` (e.g. ``{"fla-core": "0.6.0", "triton": "3.6.0"}``) go into ``manifest.json``, which
    :func:`pin_fla_configs` checks. Returns the kernel files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    by_kernel: dict[str, list[TunedConfig]] = {}
    for c in configs:
        by_kernel.setdefault(c.kernel, []).append(c)
    written = []
    for kernel, items in sorted(by_kernel.items()):
        path = out_dir / f"{kernel}.json"
        data = json.loads(path.read_text()) if path.exists() else {"kernel_name": kernel, "autotune_entries": {}}
        for c in items:
            data["autotune_entries"][key_hash(c.key)] = {"autotune_key": list(c.key), "config": c.as_fla_config()}
        # fla's own full mode (a user's FLA_CACHE_MODE=full; k3 never sets it) takes the first entry whose key has
        # the same structure, else default_config: the widest shapes' configs go first, as they fit narrower ones.
        data["autotune_entries"] = dict(sorted(data["autotune_entries"].items(),
                                               key=lambda item: -_shape_scale(item[1]["autotune_key"])))
        data["default_config"] = next(iter(data["autotune_entries"].values()))["config"]
        # Not sort_keys: the entries' order is what full mode reads. The fields go in name order all the same.
        path.write_text(json.dumps({k: data[k] for k in sorted(data)}, indent=1) + "\n")
        written.append(path)
    if versions:
        manifest = out_dir / MANIFEST
        old = json.loads(manifest.read_text()) if manifest.exists() else {}
        if old and {k: old.get(k) for k in versions} != versions:
            raise ValueError(f"{out_dir}: recorded with {old}, these results come from {versions}: write them "
                             "to a new directory")
        manifest.write_text(json.dumps({**old, **versions}, indent=1, sort_keys=True) + "\n")
    return written


def gpu_dir_name(device_name: str) -> str:
    """fla's directory name for a GPU (``sanitize_gpu_name``): ``NVIDIA H200`` → ``NVIDIA_H200``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def _manifest(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_folder(device_name: str, capability: str | None = None, root: Path = SHIPPED) -> Path | None:
    """The folder of recorded configs for ``device_name``: its own, else (given ``capability``, e.g. ``"9.0"``) the
    first by name whose manifest records that compute capability; None when neither exists."""
    own = root / gpu_dir_name(device_name)
    if _manifest(own):
        return own
    if capability is None or not root.is_dir():
        return None
    return next((folder for folder in sorted(root.iterdir())
                 if folder.is_dir() and _manifest(folder).get("compute_capability") == capability), None)


PINNED_MODES = {"1": "strict", "strict": "strict", "cover": "cover", "0": None}


def pinned_mode() -> str | None:
    """How k3 pins fla's recorded configs, from ``K3_FLA_PINNED_CONFIGS``: ``strict`` (the default; also ``1``),
    ``cover`` (also a recorded config that covers the key: checks of numbers, not speed) or None (``0``: nothing
    pinned)."""
    value = os.environ.get("K3_FLA_PINNED_CONFIGS", "strict")
    if value not in PINNED_MODES:
        raise ValueError(f"K3_FLA_PINNED_CONFIGS={value!r}: expected strict (the default: a recorded config for an "
                         "exact key, else autotune), cover (also a config recorded for a covering key: parity "
                         "checks) or 0 (fla's own behaviour)")
    return PINNED_MODES[value]


def fla_config_env(device_name: str | None, capability: str | None = None, mode: str | None = "strict",
                   root: Path = SHIPPED) -> dict[str, str]:
    """The environment that points fla at the recorded configs for ``device_name`` (or for a GPU of its compute
    ``capability``, ``"9.0"``): ``{"FLA_CONFIG_DIR": folder, "FLA_CACHE_MODE": "strict"}``, or ``{}`` when nothing
    applies: ``mode`` None, the user's own fla setting, no folder, another fla-core (see the module docstring).
    ``mode`` ``"cover"`` sets the same: its wider lookup is :func:`use_covering_configs`, once fla is imported."""
    if mode not in ("strict", "cover", None):
        raise ValueError(f"fla pinning mode {mode!r}: k3 pins 'strict' (its runs) or 'cover' (parity checks)")
    if device_name is None or mode is None:
        return {}
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ or "fla.ops.utils.cache" in sys.modules:
        return {}
    folder = recorded_folder(device_name, capability, root)
    if folder is None:
        return {}
    try:
        installed = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return {}
    if _manifest(folder).get("fla-core") != installed:
        return {}
    return {"FLA_CONFIG_DIR": str(folder), "FLA_CACHE_MODE": "strict"}


def covers(recorded: Any, requested: Any) -> bool:
    """A recorded tuning key covers a requested one: the same structure (length, flags, dtypes) and every number
    at least the requested one (head counts, head dims, chunk sizes: a config that fits a wider shape fits a
    narrower one)."""
    if isinstance(recorded, bool) or isinstance(requested, bool):
        return recorded == requested
    if isinstance(recorded, (int, float)) and isinstance(requested, (int, float)):
        return recorded >= requested
    if isinstance(recorded, (list, tuple)) and isinstance(requested, (list, tuple)):
        return len(recorded) == len(requested) and all(covers(a, b) for a, b in zip(recorded, requested))
    return recorded == requested


def covering_entry(entries: Mapping[str, Mapping[str, Any]], key: list | tuple) -> Mapping[str, Any] | None:
    """Of a kernel file's ``autotune_entries``, the narrowest whose key covers ``key`` (:func:`covers`); None when
    none does."""
    found = [e for e in entries.values() if covers(e.get("autotune_key"), list(key))]
    return min(found, key=lambda e: _shape_scale(e["autotune_key"]), default=None)


def use_covering_configs(cache: types.ModuleType) -> None:
    """Widen fla's lookup (``cache``: the imported ``fla.ops.utils.cache``, pinned in strict mode; its
    ``load_cached_config``, ``get_fla_config_dir`` and ``read_config_file`` are used) to covering keys:
    an exact key's config as before, else the config recorded for the narrowest key that covers it, else None
    (fla autotunes). Unlike fla's own full mode, which takes the first entry of the same structure whatever its
    numbers, it never hands a wide shape a config recorded for a narrower one (the tiny model's configs at K3 head
    shapes need more shared memory than a Hopper block has: measured)."""
    exact = cache.load_cached_config
    if getattr(exact, "k3_covering", False):
        return

    def load_cached_config(kernel_name: str, autotune_key: Any = None) -> dict[str, Any] | None:
        found = exact(kernel_name, autotune_key)
        if found is not None or autotune_key is None:
            return found
        # fla's own reader: parsed once per file and process, None for a missing or malformed one
        data = cache.read_config_file(Path(cache.get_fla_config_dir()) / f"{kernel_name}.json")
        entries = (data or {}).get("autotune_entries") or {}
        key = json.loads(json.dumps(list(autotune_key.autotune_key)))  # tuples to lists, as the files hold them
        entry = covering_entry(entries, key)
        return None if entry is None else dict(entry["config"])

    load_cached_config.k3_covering = True  # type: ignore[attr-defined]
    cache.load_cached_config = load_cached_config


def pin_fla_configs(device_name: str | None, root: Path = SHIPPED, capability: str | None = None) -> Path | None:
    """Point fla at the recorded configs for ``device_name``, or for a GPU of its compute ``capability`` (``"9.0"``)
    when it has none of its own, in the mode ``K3_FLA_PINNED_CONFIGS`` names (:func:`pinned_mode`; see the module
    docstring); call before fla's first import, and in ``cover`` mode :func:`use_covering_configs` after it.
    Returns the directory pinned, or None when nothing was pinned.

    Raises:
        ValueError: ``K3_FLA_PINNED_CONFIGS`` is none of strict, 1, cover, 0.
    """
    env = fla_config_env(device_name, capability, pinned_mode(), root)
    os.environ.update(env)
    return Path(env["FLA_CONFIG_DIR"]) if env else None
