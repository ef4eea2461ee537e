"""The SGLang rollout engine as a worker of the loop: one per rollout engine, colocated with the trainer ranks.

An SGLang engine is tensor/expert parallel over ``rollout_num_gpus_per_engine`` GPUs — the same GPUs as the
training ranks ``e·TP … (e+1)·TP − 1`` — and may span nodes. One :class:`SGLangEngineWorker` runs per engine per
node, in the placement bundle of the first of that node's ranks: node rank 0 (the *head*) owns the engine's
``sglang.Engine`` (scheduling, the tokenizer side, adapters, memory), the others (*followers*) only start their
TP ranks (``node_rank``) and are driven by the head.

Adapter hand-off (recipe §4.5): the head listens on the same socket hand-off as the embedded engine
(``k3.transport.handoff.serve``); :class:`SGLangAdapterForwarder` checks every chunk with the hand-off's
``AdapterReceiver`` (version, order, names, shapes, completeness — holding shapes only, on the ``meta`` device:
SGLang holds the adapter) and forwards it at once through :meth:`SGLangEngine.begin_adapter` /
:meth:`~k3.rollout.sglang.AdapterLoad.add` as one ``load_lora_adapter_from_tensors`` bucket with its first/last
flags; the first chunk of a new version unloads the old one, the last sets ``update_weight_version``. A chunk the
check rejects aborts the version: what SGLang received of it is unloaded, so a partial version is never served.
The chunk is acked only after SGLang returned, so the trainer frees its bucket only then.

Every call into SGLang runs on one thread of the worker (SGLang's ``Engine`` drives an asyncio loop that belongs
to the thread that first ran it), whether it comes from the loop (generate, memory, pause) or from the hand-off.

GPUs: the worker keeps the one GPU Ray gave its bundle (so a CUDA-IPC bucket of the source trainer rank, which
shares that bundle, maps to the same device) and starts SGLang with ``CUDA_VISIBLE_DEVICES`` = the engine's GPUs
on that node, its own first (SGLang TP rank 0 then sits on the source rank's GPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import secrets
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch

from k3.rl.workers import WorkerSpec

__all__ = ["EngineNode", "SGLangAdapterForwarder", "SGLangEngineWorker", "launch_engines", "plan_engine_nodes",
           "probe_bundles", "start_local_engine"]

# Engine e's head looks for its distributed-init ports from here (distinct per engine, so two engines that
# start on one node at once do not pick the same free port).
PORT_BASE = 30_000
PORTS_PER_ENGINE = 100
# SGLang derives a few ports right after the distributed-init port (multi-node engines): keep them free too.
DIST_PORT_SPAN = 8
PROBE_SHARE = 0.01  # of a rank's bundle, for the task that reports the bundle's node and GPU


# ------------------------------------------------------------------------------------------------ hand-off
class SGLangAdapterForwarder:
    """``serve(conn, forwarder)``'s receiver for an SGLang engine: ``receive(header, bucket) -> Ack`` per chunk.

    ``engine``: the ``SGLangEngine``; ``expected``: ``{peft_name: shape}`` of a complete version (``chunk_layout``);
    ``run(fn, *args)``: runs ``fn`` on the engine's thread (default: here).
    """

    def __init__(self, engine: Any, expected: Mapping[str, Sequence[int]],
                 run: Callable[..., Any] | None = None) -> None:
        from k3.transport.handoff import AdapterReceiver

        self.engine = engine
        # Shapes only: ``meta`` copies hold no memory, and no digest (it would need the data).
        self.checker = AdapterReceiver(expected=expected, device="meta", digest=False)
        self._run = run or (lambda fn, *args: fn(*args))
        self._load: Any | None = None
        self.forwarded = 0  # chunks SGLang accepted, over the run

    def receive(self, header: Any, bucket: torch.Tensor) -> Any:
        """Check one chunk, forward it to SGLang, ack; never raises (errors go back in the ack)."""
        from k3.transport.handoff import Ack

        ack = self.checker.receive(header, bucket)
        if not ack.ok:
            try:
                self._run(self._abort, ack.error)
            except Exception as e:  # noqa: BLE001 - the rejection is what the trainer must hear
                ack = dataclasses.replace(ack, error=f"{ack.error}; aborting the partial version failed: {e}")
            return dataclasses.replace(ack, active_version=self._active())
        try:
            self._run(self._forward, header, bucket)
        except Exception as e:  # noqa: BLE001 - the trainer gets the reason in the ack and fails the sync
            return Ack(header.version, header.index, ok=False, error=f"{type(e).__name__}: {e}",
                       active_version=self._active())
        return Ack(header.version, header.index, ok=True, active_version=self._active())

    def _active(self) -> int:
        try:
            return int(self._run(self.engine.adapter_version))
        except Exception:  # noqa: BLE001 - a shut-down engine serves nothing
            return 0

    def _forward(self, header: Any, bucket: torch.Tensor) -> None:
        from k3.lora.export import AdapterChunk
        from k3.transport.handoff import unflatten

        if header.is_first:
            if self._load is not None and self._load.is_open:  # the checker refuses this; defensive only
                self._load.abort(RuntimeError(f"version {header.version} began before version "
                                              f"{self._load.version} ended"))
            self._load = self.engine.begin_adapter(header.version)
        if self._load is None or not self._load.is_open:
            raise RuntimeError(f"chunk {header.index} of version {header.version}: no version is being loaded")
        tensors = unflatten(bucket, header.names, header.shapes)
        if self.engine.load_mode == "whole":
            # Kept until the version's last chunk: copies, since the trainer frees (or overwrites) the bucket on
            # the ack. Streamed, SGLang's payload is built from the views (a copy) and sent before the ack.
            tensors = [(name, t.clone()) for name, t in tensors]
        chunk = AdapterChunk(tensors, header.version, header.is_first, header.is_last, config=dict(header.config))
        load = self._load
        del tensors
        load.add(chunk)
        del chunk  # streamed: no reference to the bucket may outlive the ack
        self.forwarded += 1
        if header.is_last:
            self._load = None
            load.finish()

    def _abort(self, reason: str) -> None:
        load, self._load = self._load, None
        if load is not None and load.is_open:
            from k3.rollout.adapter_loader import AdapterVersionError

            load.abort(AdapterVersionError(reason))


# ------------------------------------------------------------------------------------------------ the worker
class SGLangEngineWorker:
    """One node of one SGLang rollout engine (the head when ``node_rank == 0``). Construction is cheap; SGLang
    starts in :meth:`start` (so a multi-node engine can first learn its head's address from :meth:`node_address`).

    ``spec``: the run's ``WorkerSpec`` (checkpoint, LoRA shape); ``visible_devices``: ``CUDA_VISIBLE_DEVICES`` for
    SGLang's processes (None: leave it); ``sglang_path``: a directory holding ``sglang/`` (``--sglang-path``);
    ``load_mode`` / ``pause_mode`` / ``verify_checksums``: as :class:`k3.rollout.sglang.SGLangEngine`.
    """

    def __init__(self, spec: WorkerSpec, *, engine_index: int = 0, node_rank: int = 0,
                 visible_devices: Sequence[str] | None = None, sglang_path: str | None = None,
                 load_mode: str = "auto", pause_mode: str = "retract", verify_checksums: bool = False) -> None:
        if node_rank < 0:
            raise ValueError(f"node_rank={node_rank}: expected >= 0")
        self.spec = spec
        self.engine_index = engine_index
        self.node_rank = node_rank
        self.visible_devices = None if visible_devices is None else tuple(str(d) for d in visible_devices)
        self.sglang_path = sglang_path
        self._engine_kwargs = {"load_mode": load_mode, "pause_mode": pause_mode,
                               "verify_checksums": verify_checksums}
        self.engine: Any | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                             thread_name_prefix=f"k3-sglang-{engine_index}")
        self._listener: Listener | None = None
        self._receiver: threading.Thread | None = None
        self._forwarder: SGLangAdapterForwarder | None = None
        self._error: str | None = None

    def _on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._thread.submit(fn, *args).result()

    # -- start
    def node_address(self) -> tuple[str, int]:
        """``(node IP, first free port of a run of DIST_PORT_SPAN)`` on this node, for a multi-node engine's
        ``dist_init_addr``."""
        return _node_ip(), _free_port_run(PORT_BASE + PORTS_PER_ENGINE * self.engine_index, DIST_PORT_SPAN)

    def start(self, server_args: Mapping[str, Any]) -> dict[str, Any]:
        """Start SGLang with ``server_args`` (``build_server_args`` of the run plus this node's overrides).
        Returns what the engine runs with (``load_mode``, ``tp_size``, ``node_rank``)."""
        if self.engine is not None:
            raise RuntimeError(f"engine {self.engine_index} node {self.node_rank} was started already")
        return self._on_engine_thread(self._start, dict(server_args))

    def _start(self, server_args: dict[str, Any]) -> dict[str, Any]:
        from k3.rollout import sglang as sgl

        sgl.require_sglang(self.sglang_path)
        if self.visible_devices is not None:
            # Inherited by SGLang's scheduler processes (spawned in Engine()); this worker's own GPU comes first,
            # so cuda:0 is the same device here before and after.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_devices)
            server_args.setdefault("base_gpu_id", 0)
        if self.node_rank > 0:
            os.environ[sgl.FOLLOWER_NONBLOCKING_ENV] = "0"
        tokenizer = None
        if self.node_rank == 0:
            from k3.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.spec.model_dir)
        self.engine = sgl.SGLangEngine(server_args, tokenizer=tokenizer, **self._engine_kwargs)
        return {"load_mode": self.engine.load_mode, "tp_size": int(server_args.get("tp_size", 1)),
                "node_rank": self.node_rank}

    def _head(self, what: str) -> Any:
        if self.node_rank != 0:
            raise RuntimeError(f"{what}: engine {self.engine_index} node {self.node_rank} is a follower; call its "
                               "head (node rank 0)")
        if self.engine is None:
            raise RuntimeError(f"{what}: engine {self.engine_index} was not started (call start() first)")
        return self.engine

    # -- hand-off
    def listen(self) -> tuple[str, bytes]:
        """Open the adapter socket; returns ``(address, authkey)`` for the trainer's ``TrainerWorker.connect``."""
        from k3.config import K3Config
        from k3.lora.export import chunk_layout
        from k3.transport.handoff import serve

        engine = self._head("listen")
        cfg = K3Config.from_json(Path(self.spec.model_dir) / "config.json")
        expected = {name: shape for c in chunk_layout(cfg, self.spec.lora_config()) for name, shape in c.tensors}
        self._forwarder = SGLangAdapterForwarder(engine, expected, run=self._on_engine_thread)
        path = os.path.join(tempfile.mkdtemp(prefix="k3-sync-"), "adapter.sock")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(path, family="AF_UNIX", authkey=authkey)
        listener, forwarder = self._listener, self._forwarder

        def run() -> None:
            try:
                serve(listener.accept(), forwarder)
            except Exception as e:  # noqa: BLE001 - surfaced through error()
                self._error = f"{type(e).__name__}: {e}"

        self._receiver = threading.Thread(target=run, name=f"k3-adapter-receiver-{self.engine_index}", daemon=True)
        self._receiver.start()
        return path, authkey

    def error(self) -> str | None:
        return self._error

    # -- protocol passthrough (head only), every SGLang call on the engine thread
    def generate(self, requests, sampling):
        return self._on_engine_thread(self._head("generate").generate, requests, sampling)

    def adapter_version(self) -> int:
        return self._on_engine_thread(self._head("adapter_version").adapter_version)

    def release_memory(self, tags) -> None:
        self._on_engine_thread(self._head("release_memory").release_memory, list(tags))

    def resume_memory(self, tags) -> None:
        self._on_engine_thread(self._head("resume_memory").resume_memory, list(tags))

    def released_tags(self) -> list[str]:
        return self._on_engine_thread(self._head("released_tags").released_tags)

    def pause_generation(self) -> None:
        self._on_engine_thread(self._head("pause_generation").pause_generation)

    def continue_generation(self) -> None:
        self._on_engine_thread(self._head("continue_generation").continue_generation)

    def shutdown(self) -> None:
        """Stop SGLang (the head's shutdown also stops the followers' TP ranks) and the hand-off socket."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self._on_engine_thread(engine.shutdown)
        self._thread.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class EngineNode:
    """Where one worker of one engine runs: ``bundle_rank`` is the training rank whose bundle hosts it (the first
    of ``ranks``, the engine's training ranks on that node); ``visible_devices`` their GPU ids in rank order."""

    engine_index: int
    node_rank: int
    node_ip: str
    bundle_rank: int
    ranks: tuple[int, ...]
    visible_devices: tuple[str, ...] | None


def plan_engine_nodes(num_engines: int, engine_tp: int,
                      bundles: Sequence[tuple[str, Sequence[Any]]]) -> list[list[EngineNode]]:
    """The workers of every engine: engine ``e`` takes training ranks ``e·engine_tp … (e+1)·engine_tp − 1``;
    its node ranks follow its nodes in rank order (node rank 0 holds rank ``e·engine_tp``, the source rank of the
    adapter hand-off). ``bundles[r]`` is ``(node IP, GPU ids)`` of rank ``r``'s bundle (no GPU ids: a CPU run,
    ``visible_devices`` None). Raises ``ValueError`` when the ranks do not cover the engines or an engine spans
    its nodes unevenly (SGLang gives every node of an engine the same number of TP ranks)."""
    if num_engines < 1 or engine_tp < 1:
        raise ValueError(f"num_engines={num_engines}, engine_tp={engine_tp}: both must be >= 1")
    need = num_engines * engine_tp
    if len(bundles) < need:
        raise ValueError(f"{num_engines} engines of TP {engine_tp} need {need} GPU bundles; the placement has "
                         f"{len(bundles)}")
    plans = []
    for e in range(num_engines):
        ranks = list(range(e * engine_tp, (e + 1) * engine_tp))
        by_node: dict[str, list[int]] = {}
        for r in ranks:
            by_node.setdefault(str(bundles[r][0]), []).append(r)
        sizes = {len(v) for v in by_node.values()}
        if len(sizes) != 1:
            raise ValueError(f"engine {e} (ranks {ranks[0]}..{ranks[-1]}) spans its nodes unevenly "
                             f"({ {ip: len(v) for ip, v in by_node.items()} }): SGLang needs the same TP ranks on "
                             "every node of an engine; use whole nodes per engine (--rollout-tp-size)")
        nodes = []
        for k, (ip, node_ranks) in enumerate(by_node.items()):
            gpus = [list(bundles[r][1]) for r in node_ranks]
            devices = None if any(not g for g in gpus) else tuple(str(g[0]) for g in gpus)
            nodes.append(EngineNode(e, k, ip, node_ranks[0], tuple(node_ranks), devices))
        plans.append(nodes)
    return plans


def _bundle_identity() -> tuple[str, list[str]]:
    import ray

    return _node_ip(), [str(g) for g in ray.get_gpu_ids()]


def probe_bundles(placement: Any, num_ranks: int) -> list[tuple[str, list[str]]]:
    """``(node IP, GPU ids)`` of the bundles of training ranks ``0 … num_ranks − 1`` (one tiny task in each)."""
    import ray

    probe = ray.remote(_bundle_identity)
    return ray.get([probe.options(**placement.actor_options(r, share=PROBE_SHARE)).remote()
                    for r in range(num_ranks)])


def _engine_kwargs(resolved: Any) -> dict[str, Any]:
    a = resolved.args
    return {"sglang_path": a.sglang_path, "verify_checksums": bool(a.check_weight_update_equal)}


def launch_engines(resolved: Any, placement: Any, spec: WorkerSpec) -> list[Any]:
    """Start every rollout engine of ``resolved`` on ``placement`` (Ray); returns the heads' actor handles, in
    engine order. Followers are created in their bundles too (the placement kills them at shutdown)."""
    import ray

    from k3.rollout.sglang import build_server_args

    layout = resolved.layout
    plans = plan_engine_nodes(layout.num_rollout_engines, layout.rollout_tp_size,
                              probe_bundles(placement, layout.num_rollout_engines * layout.rollout_tp_size))
    cls = ray.remote(SGLangEngineWorker)
    heads, started = [], []
    for nodes in plans:
        actors = [placement.create_actor(cls, n.bundle_rank, "engine", spec, engine_index=n.engine_index,
                                         node_rank=n.node_rank, visible_devices=n.visible_devices,
                                         **_engine_kwargs(resolved)) for n in nodes]
        overrides: dict[str, Any] = {}
        if len(nodes) > 1:
            ip, port = ray.get(actors[0].node_address.remote())
            overrides["dist_init_addr"] = f"{ip}:{port}"
        for node, actor in zip(nodes, actors):
            node_rank = node.node_rank if len(nodes) > 1 else None
            started.append(actor.start.remote(build_server_args(resolved, **overrides, node_rank=node_rank)))
        heads.append(actors[0])
    ray.get(started)  # every node of every engine up (the TP ranks of an engine start together)
    return heads


def start_local_engine(resolved: Any, spec: WorkerSpec) -> SGLangEngineWorker:
    """The one engine of an in-process run (tests, one-GPU machines), started."""
    from k3.rollout.sglang import build_server_args

    if resolved.layout.num_rollout_engines != 1:
        raise ValueError(f"an in-process run has one rollout engine; this layout has "
                         f"{resolved.layout.num_rollout_engines} (run it under Ray)")
    worker = SGLangEngineWorker(spec, **_engine_kwargs(resolved))
    worker.start(build_server_args(resolved))
    return worker


# ------------------------------------------------------------------------------------------------ helpers
def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def _free_port_run(start: int, span: int) -> int:
    """The first port ``p >= start`` with ``p … p + span − 1`` all free on this node."""
    p = start
    while p + span <= 65_536:
        for q in range(p, p + span):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", q))
                except OSError:
                    p = q + 1
                    break
        else:
            return p
    raise RuntimeError(f"no {span} consecutive free ports from {start} on this node")
