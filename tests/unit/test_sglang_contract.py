"""`k3.rollout.sglang` against the real source of the pinned SGLang, without running SGLang.

The test downloads the pinned wheel (``pip download --no-deps sglang==<SGLANG_VERSION>``; reused from
``~/.cache/k3-lora-rl/`` when present, or ``K3_SGLANG_WHEEL=path`` offline) and reads it with ``ast``:

* every entry of ``SGLANG_SURFACE`` exists — the class, the method with its sync/async kind, the positional
  count and every keyword we pass (and no required parameter we leave out), the request struct's fields;
* ``SGLangBackend`` (the only code that calls sglang) uses exactly what ``SGLANG_SURFACE`` declares;
* every server argument ``build_server_args`` emits is a ServerArgs field whose type and choices admit the
  value; every sampling key is a SamplingParams field; result keys, finish types, memory tags and the
  log-probability switch are SGLang's;
* SGLang's own ``FlattenedTensorBucket`` and ``SafeUnpickler`` (executed from the wheel, they need only torch)
  reconstruct our payload bit for bit.

Skipped with the reason when the registry cannot be reached.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import types
import zipfile
from pathlib import Path

import pytest
import torch

import k3.rollout.sglang.backend as sglang_backend
import k3.rollout.sglang.surface as sgl
from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.rollout.protocol import MEMORY_TAGS, SamplingParams
from k3.rollout.sglang.payload import build_lora_payload, sglang_bucket_payload
from k3.rollout.sglang.sampling import build_sampling_params
from k3.rollout.sglang.server_args import build_server_args

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("K3_CACHE_DIR", Path.home() / ".cache" / "k3-lora-rl")) / f"sglang-{sgl.SGLANG_VERSION}"
_NETWORK_SIGNS = ("from versions: none", "Max retries", "Temporary failure in name resolution",
                  "Network is unreachable", "Connection refused", "ConnectionError", "timed out",
                  "Name or service not known")


# ============================================================================ fetching and reading the wheel
def _fetch_wheel() -> Path:
    if os.environ.get("K3_SGLANG_WHEEL"):
        path = Path(os.environ["K3_SGLANG_WHEEL"])
        if not path.is_file():
            pytest.fail(f"K3_SGLANG_WHEEL={path} is not a file")
        return path
    cached = sorted(CACHE.glob(f"sglang-{sgl.SGLANG_VERSION}-*.whl"))
    if cached:
        return cached[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        # A fixed target (the CPython 3.11 Linux wheel) so every machine reads the same artifact.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
               "--implementation", "cp", "--abi", "cp311", "--platform", "manylinux_2_34_x86_64", "--timeout", "30",
               "--retries", "1", "--disable-pip-version-check", "-q", "-d", tmp, f"sglang=={sgl.SGLANG_VERSION}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"fetching sglang=={sgl.SGLANG_VERSION} from the package registry timed out")
        if proc.returncode != 0:
            text = (proc.stdout + proc.stderr).strip()
            network = [line.strip() for line in text.splitlines() if any(s in line for s in _NETWORK_SIGNS)]
            if network:
                pytest.skip(f"package registry unreachable, cannot fetch sglang=={sgl.SGLANG_VERSION} to check "
                            f"k3.rollout.sglang against its source: {network[0][:200]}")
            pytest.fail(f"pip could not download sglang=={sgl.SGLANG_VERSION} (is the pin right?):\n{text}")
        wheels = sorted(Path(tmp).glob("sglang-*.whl"))
        if not wheels:
            pytest.fail(f"pip download left no sglang wheel in {tmp}")
        target = CACHE / wheels[0].name
        os.replace(wheels[0], target)  # atomic: parallel test workers may race to fill the cache
    return target


class Source:
    """The pinned SGLang's python files, read from its wheel."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())

    def has(self, path: str) -> bool:
        return path in self._names

    def text(self, path: str) -> str:
        if path not in self._names:
            raise AssertionError(f"{path} is not in {self.wheel.name}")
        return self._zip.read(path).decode()

    @functools.lru_cache(maxsize=None)
    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.text(path), filename=path)

    def module_path(self, dotted: str) -> str:
        base = dotted.replace(".", "/")
        return base + ".py" if self.has(base + ".py") else base + "/__init__.py"

    def imported(self, path: str, name: str) -> str | None:
        """The file ``name`` is imported from in ``path`` (``from X import name``), if it is."""
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
                return self.module_path(node.module)
        return None

    def find_class(self, path: str, name: str) -> tuple[str, ast.ClassDef]:
        for node in self.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return path, node
        origin = self.imported(path, name)
        if origin is None:
            raise AssertionError(f"class {name} is not defined in {path}")
        return self.find_class(origin, name)

    def lineage(self, path: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its base classes that are SGLang's (resolvable in the wheel), nearest first."""
        out = [self.find_class(path, name)]
        where, cls = out[0]
        for base in cls.bases:
            if isinstance(base, ast.Name):
                try:
                    out.extend(self.lineage(where, base.id))
                except AssertionError:
                    pass  # a base from outside SGLang (msgspec.Struct, a stdlib class)
        return out

    def method(self, path: str, target: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        cls_name, name = target.split(".")
        for _, cls in self.lineage(path, cls_name):
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
        raise AssertionError(f"{target} is not defined in {path} (nor in its SGLang base classes)")

    def fields(self, path: str, name: str) -> dict[str, ast.AnnAssign]:
        """Annotated class-body fields (msgspec struct / dataclass), base classes included."""
        out: dict[str, ast.AnnAssign] = {}
        for _, cls in reversed(self.lineage(path, name)):
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    out[node.target.id] = node
        return out

    def module_value(self, path: str, name: str) -> ast.expr | None:
        for node in self.tree(path).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return node.value
        origin = self.imported(path, name)
        return self.module_value(origin, name) if origin else None

    def literal_list(self, path: str, node: ast.expr | None) -> list | None:
        """A list / tuple / set of constants the expression evaluates to, following names; None if not static."""
        if node is None:
            return None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            out = []
            for elt in node.elts:
                value = self.literal_scalar(path, elt)
                if value is None:
                    return None
                out.append(value)
            return out
        if isinstance(node, ast.Name):
            return self.literal_list(path, self.module_value(path, node.id))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.literal_list(path, node.left), self.literal_list(path, node.right)
            return None if left is None or right is None else left + right
        return None

    def literal_scalar(self, path: str, node: ast.expr | None):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.literal_scalar(path, self.module_value(path, node.id))
        return None


@pytest.fixture(scope="module")
def src() -> Source:
    return Source(_fetch_wheel())


# ============================================================================ version and pin
def test_the_wheel_is_the_pinned_release_and_pyproject_admits_it(src):
    metadata = src.text(f"sglang-{sgl.SGLANG_VERSION}.dist-info/METADATA")
    assert re.search(rf"^Version: {re.escape(sgl.SGLANG_VERSION)}$", metadata, re.M)
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras["cluster"] if Requirement(r).name == "sglang"]
    assert reqs, "pyproject's cluster extra does not list sglang"
    assert reqs[0].specifier.contains(sgl.SGLANG_VERSION), (
        f"pyproject's cluster extra {reqs[0]} excludes the pinned sglang {sgl.SGLANG_VERSION}")


def test_sglang_exports_engine(src):
    exported = {t.id for node in src.tree("sglang/__init__.py").body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert "Engine" in exported


# ============================================================================ the surface, entry by entry
def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool):
    """(positional parameter names, how many of them have defaults, keyword-only {name: has default}, **kw?)"""
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if is_method and not static:
        positional = positional[1:]  # self
    kwonly = {a.arg: d is not None for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)}
    return positional, len(fn.args.defaults), kwonly, fn.args.kwarg is not None, fn.args.vararg is not None


def _check_call(fn, use: sgl.SGLangUse, is_method: bool) -> None:
    positional, n_defaults, kwonly, has_kwargs, has_varargs = _params(fn, is_method)
    where = f"{use.target} ({use.module}:{fn.lineno})"
    if use.positional > len(positional) and not has_varargs:
        raise AssertionError(f"{where} takes {len(positional)} positional arguments; we pass {use.positional}")
    names = set(positional) | set(kwonly)
    unknown = [k for k in use.keywords if k not in names]
    if unknown and not has_kwargs:
        raise AssertionError(f"{where} has no parameter {unknown} (it has {sorted(names)})")
    required = positional[:len(positional) - n_defaults] + [k for k, has_default in kwonly.items() if not has_default]
    missing = [p for p in required[use.positional:] if p not in use.keywords]
    if missing:
        raise AssertionError(f"{where} requires {missing}, which we do not pass")


@pytest.mark.parametrize("use", sgl.SGLANG_SURFACE, ids=lambda u: u.target)
def test_surface_entry_exists_with_that_signature(src, use):
    if use.kind in ("method", "async_method"):
        fn = src.method(use.module, use.target)
        want = ast.AsyncFunctionDef if use.kind == "async_method" else ast.FunctionDef
        assert isinstance(fn, want), f"{use.target} is {'async' if isinstance(fn, ast.AsyncFunctionDef) else 'sync'}"
        _check_call(fn, use, is_method=True)
    elif use.kind == "function":
        fns = [n for n in src.tree(use.module).body if isinstance(n, ast.FunctionDef) and n.name == use.target]
        assert fns, f"function {use.target} is not defined in {use.module}"
        _check_call(fns[0], use, is_method=False)
    elif use.kind == "struct":
        fields = src.fields(use.module, use.target)
        unknown = [k for k in use.keywords if k not in fields]
        assert not unknown, f"{use.target} has no field {unknown} (fields: {sorted(fields)})"
        required = [n for n, f in fields.items() if f.value is None]
        missing = [n for n in required if n not in use.keywords]
        assert not missing, f"{use.target} requires {missing}, which we do not pass"
    elif use.kind == "attribute":
        cls_name, attr = use.target.split(".")
        init = src.method(use.module, f"{cls_name}.__init__")
        assigned = {t.attr for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        assert attr in assigned, f"{cls_name}.__init__ does not set self.{attr}"
    elif use.kind == "kwargs_class":
        init = src.method(use.module, f"{use.target}.__init__")
        assert init.args.kwarg is not None, f"{use.target}.__init__ does not take **kwargs"
    else:
        raise AssertionError(f"unknown kind {use.kind!r} in SGLANG_SURFACE")


def test_streamed_loading_matches_the_pinned_request_struct(src):
    fields = src.fields("sglang/srt/managers/io_struct.py", "LoadLoRAAdapterFromTensorsReqInput")
    present = [f for f in sgl.STREAMED_LOAD_FIELDS if f in fields]
    assert sgl.supports_streamed_lora_load(fields) == (len(present) == len(sgl.STREAMED_LOAD_FIELDS))
    if sgl.SGLANG_VERSION == "0.5.23":
        # Upstream 0.5.23 takes an adapter in one call: the engine's `auto` mode picks `whole` there.
        assert present == []


# ============================================================================ what the backend really calls
def _backend_uses() -> list[tuple[str, str, int, tuple[str, ...], str]]:
    """(kind, target, positional, keywords, module) of every sglang use in ``SGLangBackend``'s source."""
    tree = ast.parse(Path(sglang_backend.__file__).read_text())
    backend = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SGLangBackend")
    imported: dict[str, str] = {}
    for node in ast.walk(backend):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang"):
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module.replace(".", "/") + ".py"
    owners = {"_engine": ("Engine", sgl._ENGINE), "_tm": ("TokenizerManager", sgl._TOKENIZER_MANAGER)}

    def owner_of(node: ast.expr) -> tuple[str, str] | None:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr in owners):
            return owners[node.attr]
        return None

    # An imported class handed to one of our module functions is called there through that parameter
    # (``sglang_bucket_payload(flat, entries, FlattenedTensorMetadata)`` builds the metadata objects): the
    # backend's own functions and those it imports from the other modules of k3.rollout.sglang.
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3.rollout.sglang."):
            ours = ast.parse((REPO / (node.module.replace(".", "/") + ".py")).read_text())
            names = {a.name for a in node.names}
            functions.update({n.name: n for n in ours.body if isinstance(n, ast.FunctionDef) and n.name in names})

    def calls_through(fn: ast.FunctionDef, position: int):
        param = fn.args.args[position].arg
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == param:
                yield node

    uses, call_funcs = [], set()
    for node in ast.walk(backend):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in functions:
            for i, arg in enumerate(node.args):
                if isinstance(arg, ast.Name) and arg.id in imported:
                    for inner in calls_through(functions[node.func.id], i):
                        keywords = tuple(k.arg for k in inner.keywords if k.arg is not None)
                        uses.append(("call", arg.id, len(inner.args), keywords, imported[arg.id]))
        f, target = node.func, None
        if isinstance(f, ast.Attribute) and owner_of(f.value):
            cls, module = owner_of(f.value)
            target = (f"{cls}.{f.attr}", module)
        elif isinstance(f, ast.Name) and f.id in imported:
            target = (f.id, imported[f.id])
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in imported:
            target = (f"{f.value.id}.{f.attr}", imported[f.value.id])
        if target:
            call_funcs.add(id(f))
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            uses.append(("call", target[0], len(node.args), keywords, target[1]))
    for node in ast.walk(backend):
        if isinstance(node, ast.Attribute) and id(node) not in call_funcs and owner_of(node.value):
            cls, module = owner_of(node.value)
            uses.append(("attribute", f"{cls}.{node.attr}", 0, (), module))
        elif (isinstance(node, ast.Attribute) and id(node) not in call_funcs and isinstance(node.value, ast.Name)
              and node.value.id in imported and not node.attr.startswith("__")):
            uses.append(("attribute", f"{node.value.id}.{node.attr}", 0, (), imported[node.value.id]))
    return uses


def test_the_backend_uses_only_the_declared_surface():
    declared = {u.target: u for u in sgl.SGLANG_SURFACE}
    problems = []
    for kind, target, positional, keywords, module in _backend_uses():
        use = declared.get(target)
        if use is None:
            problems.append(f"{target} is used but not declared in SGLANG_SURFACE")
            continue
        if (kind == "attribute") != (use.kind == "attribute"):
            problems.append(f"{target} is used as {kind} but declared as {use.kind}")
        if use.module != module:
            problems.append(f"{target} comes from {module} but is declared in {use.module}")
        if kind == "call" and positional != use.positional:
            problems.append(f"{target} is called with {positional} positional arguments, declared {use.positional}")
        extra = [k for k in keywords if k not in use.keywords + use.optional_keywords]
        if extra:
            problems.append(f"{target} is called with undeclared keywords {extra}")
    assert not problems, "\n".join(problems)


def test_every_declared_use_is_used():
    used = {target for _, target, *_ in _backend_uses()}
    unused = [u.target for u in sgl.SGLANG_SURFACE if u.target not in used]
    assert not unused, f"SGLANG_SURFACE declares {unused}, which SGLangBackend never uses"


def test_declared_keywords_are_the_ones_passed():
    passed: dict[str, set[str]] = {}
    for _, target, _, keywords, _ in _backend_uses():
        passed.setdefault(target, set()).update(keywords)
    stale = {u.target: sorted(set(u.keywords + u.optional_keywords) - passed.get(u.target, set()))
             for u in sgl.SGLANG_SURFACE}
    stale = {t: k for t, k in stale.items() if k}
    assert not stale, f"SGLANG_SURFACE declares keywords SGLangBackend never passes: {stale}"


# ============================================================================ server args, sampling, results
def _server_arg_fields(src: Source) -> dict[str, tuple[str, ast.AnnAssign]]:
    """ServerArgs' input fields: {name: (declaring file, its AnnAssign)} from the namespaces it collects."""
    server_args = "sglang/srt/server_args.py"
    namespaces = src.module_value(server_args, "_INPUT_NAMESPACES")
    assert isinstance(namespaces, ast.List), "server_args.py: _INPUT_NAMESPACES is not a list literal"
    out = {}
    for elt in namespaces.elts:
        path, _ = src.find_class(server_args, elt.id)
        for name, node in src.fields(path, elt.id).items():
            out[name] = (path, node)
    return out


def _field_type(node: ast.AnnAssign) -> ast.expr:
    ann = node.annotation  # A[T, help-or-Arg(...)]
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A":
        return ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
    return ann


def _field_choices(src: Source, path: str, node: ast.AnnAssign) -> list | None:
    ann = node.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) > 1):
        return None
    meta = ann.slice.elts[1]
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        for kw in meta.keywords:
            if kw.arg == "choices":
                return src.literal_list(path, kw.value)
    return None


def _fits(node: ast.expr, value) -> bool:
    """Whether ``value`` is an instance of the annotation ``node`` (the subset of typing SGLang's fields use)."""
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        return _fits(ast.parse(node.value, mode="eval").body, value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _fits(node.left, value) or _fits(node.right, value)
    if isinstance(node, ast.Name) or isinstance(node, ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        kinds = {"bool": bool, "int": int, "float": (int, float), "str": str, "dict": dict, "list": list,
                 "Dict": dict, "List": list}
        if name == "Any":
            return True
        if name not in kinds:
            return True  # a class of SGLang's: not checked here
        if isinstance(value, bool) and name != "bool":
            return False
        return isinstance(value, kinds[name])
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Optional":
            return value is None or _fits(args[0], value)
        if base == "Union":
            return any(_fits(a, value) for a in args)
        if base == "Literal":
            return value in [a.value for a in args if isinstance(a, ast.Constant)]
        if base in ("List", "list", "Set", "set", "Tuple", "tuple", "Sequence"):
            return isinstance(value, (list, tuple, set)) and all(_fits(args[0], v) for v in value)
        if base in ("Dict", "dict"):
            return isinstance(value, dict)
    return True


def _server_settings(words: str):
    """What ``build_server_args`` takes, of a resolved ``k3 train`` command line."""
    settings = resolve(parse_train_args(words.split(), environ={})).settings
    return settings.rollout, settings.lora, settings.colocate


SERVER_ARG_CASES = {
    "4layer": (("--model-variant 4layer --backend megatron --rollout-engine sglang --task dapo-math "
                "--hf-checkpoint /ckpt --run-id t"), {}),
    "4layer-no-backup": (("--model-variant 4layer --rollout-engine sglang --no-lora-base-cpu-backup "
                          "--sglang-max-total-tokens 4096 --hf-checkpoint /ckpt --run-id t"), {}),
    "full-validated": (("--mode normal --model-variant full --task dapo-math --num-nodes 16 --num-gpus-per-node 4 "
                        "--pipeline-parallel-size 8 --context-parallel-size 2 --rollout-tp-size 16 "
                        "--rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64 --sglang-max-total-tokens 65536 "
                        "--global-batch-size 64 --rollout-engine sglang --run-id v"),
                       {"dist_init_addr": "10.0.0.1:5000", "node_rank": 0}),
    "full-tp8": (("--mode normal --model-variant full --num-nodes 16 --num-gpus-per-node 4 --rollout-tp-size 8 "
                  "--rollout-ep-size 8 --rollout-engine sglang --run-id w"), {"dist_init_addr": "h:1", "node_rank": 1}),
    # What k3.rollout.sglang.start adds per node: the head's address, the node's rank, GPUs counted from its own.
    "full-validated-follower": (("--mode normal --model-variant full --num-nodes 16 --num-gpus-per-node 4 "
                                 "--pipeline-parallel-size 8 --context-parallel-size 2 --rollout-tp-size 16 "
                                 "--rollout-engine sglang --run-id f"),
                                {"dist_init_addr": "10.0.1.8:30200", "node_rank": 3, "base_gpu_id": 0}),
}


@pytest.mark.parametrize("case", list(SERVER_ARG_CASES))
def test_server_args_are_sglang_fields_with_fitting_values(src, case):
    words, overrides = SERVER_ARG_CASES[case]
    args = build_server_args(*_server_settings(words), **overrides)
    fields = _server_arg_fields(src)
    problems = []
    for key, value in args.items():
        if key not in fields:
            problems.append(f"{key} is not a ServerArgs field")
            continue
        path, node = fields[key]
        if not _fits(_field_type(node), value):
            problems.append(f"{key}={value!r} does not fit {ast.unparse(_field_type(node))} ({path}:{node.lineno})")
        choices = _field_choices(src, path, node)
        if choices is not None:
            values = value if isinstance(value, (list, tuple, set)) else [value]
            bad = [v for v in values if v not in choices]
            if bad:
                problems.append(f"{key}={value!r}: {bad} not among SGLang's choices {choices}")
    assert not problems, "\n".join(problems)


def test_sampling_keys_are_sglang_sampling_params(src):
    params = build_sampling_params(SamplingParams(temperature=0.5, top_p=0.5, max_new_tokens=3, seed=1,
                                                      stop_token_ids=(4,)), 2, stop_token_ids=(2,))
    fields = src.fields("sglang/srt/sampling/sampling_params.py", "SamplingParams")
    for key, value in params[0].items():
        assert key in fields, f"{key} is not a SamplingParams field"
        assert _fits(fields[key].annotation, value), f"{key}={value!r} vs {ast.unparse(fields[key].annotation)}"


def _dict_keys(tree: ast.Module) -> set[str]:
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def test_result_keys_are_what_the_tokenizer_manager_returns(src):
    keys = _dict_keys(src.tree("sglang/srt/managers/tokenizer_manager.py"))
    missing = [k for k in sgl.SGLANG_RESULT_KEYS + sgl.SGLANG_META_KEYS if k not in keys]
    assert not missing, f"tokenizer_manager.py never builds result keys {missing}"


def test_finish_reason_types_are_sglangs(src):
    types_ = set()
    for node in ast.walk(src.tree("sglang/srt/managers/schedule_batch.py")):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "type" and isinstance(value, ast.Constant):
                    types_.add(value.value)
    assert set(sgl.SGLANG_FINISH_TYPES) | {"abort"} <= types_, types_


def test_memory_tags_are_sglangs(src):
    values = {name: src.literal_scalar("sglang/srt/constants.py", src.module_value("sglang/srt/constants.py", name))
              for name in sgl.SGLANG_MEMORY_TAG_CONSTANTS}
    assert values == sgl.SGLANG_MEMORY_TAG_CONSTANTS
    assert set(values.values()) == set(MEMORY_TAGS)


def test_the_follower_switch_exists(src):
    """Our follower workers (node_rank >= 1 of a multi-node engine) set it so Engine() returns once ready."""
    strings = {n.value for n in ast.walk(src.tree(sgl._ENGINE)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert sgl.FOLLOWER_NONBLOCKING_ENV in strings


def test_the_original_logprob_switch_exists(src):
    strings = {n.value for n in ast.walk(src.tree("sglang/srt/layers/sampler.py"))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert sgl.RETURN_ORIGINAL_LOGPROB_ENV in strings


# ============================================================================ SGLang's own code on our payload
@pytest.fixture
def tensor_bucket(src, monkeypatch):
    """sglang.srt.weight_sync.tensor_bucket from the wheel (it imports only dataclasses, typing and torch)."""
    name, path = "sglang.srt.weight_sync.tensor_bucket", "sglang/srt/weight_sync/tensor_bucket.py"
    module = types.ModuleType(name)
    module.__file__ = path
    # Registered before it runs (dataclasses look their module up) and under SGLang's path with stand-in
    # parent packages, so its classes pickle as SGLang's.
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(src.text(path), path, "exec"), module.__dict__)
    return module


def _adapter_like() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = "language_model.model.layers.1.block_sparse_moe.experts."
    return [(p + "w1.lora_A.weight", torch.randn(1, 4, 6, generator=g).bfloat16()),
            (p + "w1.lora_B.weight", torch.randn(3, 5, 4, generator=g).bfloat16()),
            (p + "w2.lora_A.weight", torch.randn(3, 4, 5, generator=g).bfloat16()),
            (p + "w2.lora_B.weight", torch.randn(1, 6, 4, generator=g).bfloat16())]


def test_sglang_bucket_reconstructs_our_payload(tensor_bucket):
    named = _adapter_like()
    flat, entries = build_lora_payload(named)
    payload = sglang_bucket_payload(flat, entries, tensor_bucket.FlattenedTensorMetadata)
    bucket = tensor_bucket.FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                                 metadata=payload["metadata"])
    back = bucket.reconstruct_tensors()
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(back, named))
    # SGLang's own flattening of the same tensors is byte-identical to ours.
    theirs = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
    assert torch.equal(theirs.get_flattened_tensor(), flat)
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in theirs.get_metadata()] == [
        (e.name, e.shape, e.dtype, e.start, e.end, e.nbytes) for e in entries]


def test_our_payload_passes_sglangs_safe_unpickler(src, tensor_bucket):
    """Serialized like MultiprocessingSerializer does (ForkingPickler), loaded by SGLang's SafeUnpickler."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

    common = src.tree("sglang/srt/utils/common.py")
    wanted = {"SafeUnpickler", "_safe_load_torch_storage"}
    namespace = {"pickle": pickle, "io": io, "torch": torch}
    for node in common.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in wanted:
            exec(compile(ast.Module([node], []), "sglang/srt/utils/common.py", "exec"), namespace)
    assert wanted <= set(namespace)

    named = _adapter_like()
    flat, entries = build_lora_payload(named)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(sglang_bucket_payload(flat, entries, tensor_bucket.FlattenedTensorMetadata))
    data = namespace["SafeUnpickler"](io.BytesIO(buf.getvalue())).load()
    bucket = tensor_bucket.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    back = bucket.reconstruct_tensors()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named))
