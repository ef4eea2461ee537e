"""One node of one SGLang rollout engine as a worker of the loop, colocated with the engine's training ranks.

An SGLang engine is tensor/expert parallel over ``rollout_num_gpus_per_engine`` GPUs — the same GPUs as the
training ranks ``e·TP … (e+1)·TP − 1`` — and may span nodes. One :class:`SGLangEngineWorker` runs per engine per
node, in the placement bundle of the first of that node's ranks (``k3.rollout.sglang.placement``): node rank 0
(the *head*) owns the engine's ``sglang.Engine`` (scheduling, the tokenizer side, adapters, memory) and receives
the adapter hand-off (``k3.rollout.sglang.forwarder``), the others (*followers*) only start their TP ranks
(``node_rank``) and are driven by the head.

Every call into SGLang runs on one thread of the worker (SGLang's ``Engine`` drives an asyncio loop that belongs
to the thread that first ran it), whether it comes from the loop (generate, memory, pause) or from the hand-off.

GPUs: the worker keeps the one GPU Ray gave its bundle (so a CUDA-IPC bucket of the source trainer rank, which
shares that bundle, maps to the same device) and starts SGLang with ``CUDA_VISIBLE_DEVICES`` = the engine's GPUs
on that node, its own first (SGLang TP rank 0 then sits on the source rank's GPU). SGLang puts TP ranks
``k·n … (k+1)·n − 1`` on node rank ``k`` (``n`` GPUs per node), in that order on its visible GPUs, so with the
placement's node order (``plan_engine_nodes``) engine rank ``i`` runs on the GPU of training rank ``e·TP + i``.

Adapters: the head's ``rank_slots`` (``engine_rank_slots``) say which trainer rank, node and GPU each engine rank
has. In ``streamed`` mode the engine is fed rank by rank (``rank_feed``: each engine rank's payload made by the
trainer rank on its GPU, gathered over the trainer's collectives, recipe §4.5); the only way into an engine that
spans nodes, since a CUDA IPC handle opens only on its own node. ``whole`` mode (upstream SGLang: one bucket per
version, made by the head) serves only an engine on one node.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from k3.config import K3Config
from k3.lora.export import chunk_layout
from k3.rollout.protocol import GenerateRequest, Sample, SamplingParams
from k3.rollout.sglang.engine import SGLangEngine
from k3.rollout.sglang.forwarder import SGLangAdapterForwarder
from k3.rollout.sglang.errors import SGLangError
from k3.rollout.sglang.placement import free_port_run, node_ip
from k3.rollout.sglang.rank_payload import serialize_rank_payload
from k3.rollout.sglang.surface import FOLLOWER_NONBLOCKING_ENV, require_sglang
from k3.settings.worker import WorkerSpec
from k3.tokenizer import load_tokenizer
from k3.transport.handoff import serve
from k3.transport.rank_feed import RankFeed, RankSlot

__all__ = ["DIST_PORT_SPAN", "PORT_BASE", "PORTS_PER_ENGINE", "SGLangEngineWorker"]

# Engine e's head looks for its distributed-init ports from here (distinct per engine, so two engines that
# start on one node at once do not pick the same free port).
PORT_BASE = 30_000
PORTS_PER_ENGINE = 100
# SGLang derives a few ports right after the distributed-init port (multi-node engines): keep them free too.
DIST_PORT_SPAN = 8


class SGLangEngineWorker:
    """One node of one SGLang rollout engine (the head when ``node_rank == 0``). Construction is cheap; SGLang
    starts in :meth:`start` (so a multi-node engine can first learn its head's address from :meth:`node_address`).

    ``spec``: the run's ``WorkerSpec`` (checkpoint, LoRA shape); ``visible_devices``: ``CUDA_VISIBLE_DEVICES`` for
    SGLang's processes (None: leave it); ``sglang_path``: a directory holding ``sglang/`` (``--sglang-path``);
    ``load_mode`` / ``pause_mode`` / ``verify_checksums``: as ``k3.rollout.sglang.engine.SGLangEngine``;
    ``rank_slots`` (the head only): engine rank ``i``'s trainer rank, node and GPU at ``i``
    (``placement.engine_rank_slots``; None: the engine is fed one bucket per chunk, on one node).
    """

    def __init__(self, spec: WorkerSpec, *, engine_index: int = 0, node_rank: int = 0,
                 visible_devices: Sequence[str] | None = None, sglang_path: str | None = None,
                 load_mode: str = "auto", pause_mode: str = "retract", verify_checksums: bool = False,
                 rank_slots: Sequence[RankSlot] | None = None) -> None:
        if node_rank < 0:
            raise ValueError(f"node_rank={node_rank}: expected >= 0")
        if rank_slots is not None:
            if node_rank != 0:
                raise ValueError(f"engine {engine_index} node {node_rank}: only the head (node rank 0) takes the "
                                 "engine's rank slots")
            _check_head_devices(engine_index, tuple(rank_slots), visible_devices)
        self.rank_slots = None if rank_slots is None else tuple(rank_slots)
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
        self._feed: RankFeed | None = None
        self._error: str | None = None

    def _on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._thread.submit(fn, *args).result()

    # -- start
    def node_address(self) -> tuple[str, int]:
        """``(node IP, first free port of a run of DIST_PORT_SPAN)`` on this node, for a multi-node engine's
        ``dist_init_addr``."""
        return node_ip(), free_port_run(PORT_BASE + PORTS_PER_ENGINE * self.engine_index, DIST_PORT_SPAN)

    def start(self, server_args: Mapping[str, Any]) -> dict[str, Any]:
        """Start SGLang with ``server_args`` (``build_server_args`` of the run plus this node's overrides).
        Returns what the engine runs with (``load_mode``, ``tp_size``, ``node_rank``)."""
        if self.engine is not None:
            raise RuntimeError(f"engine {self.engine_index} node {self.node_rank} was started already")
        return self._on_engine_thread(self._start, dict(server_args))

    def _start(self, server_args: dict[str, Any]) -> dict[str, Any]:
        require_sglang(self.sglang_path)
        if self.visible_devices is not None:
            # Inherited by SGLang's scheduler processes (spawned in Engine()); this worker's own GPU comes first,
            # so cuda:0 is the same device here before and after.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_devices)
            server_args.setdefault("base_gpu_id", 0)
        if self.node_rank > 0:
            os.environ[FOLLOWER_NONBLOCKING_ENV] = "0"
        tokenizer = None
        if self.node_rank == 0:
            tokenizer = load_tokenizer(self.spec.model_dir)
        self.engine = SGLangEngine(server_args, tokenizer=tokenizer, **self._engine_kwargs)
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
        engine = self._head("listen")
        cfg = K3Config.from_json(Path(self.spec.model_dir) / "config.json")
        expected = {name: shape for c in chunk_layout(cfg, self.spec.lora) for name, shape in c.tensors}
        self._feed = self._plan_feed(engine)
        self._forwarder = SGLangAdapterForwarder(engine, expected, run=self._on_engine_thread, feed=self._feed)
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

    def rank_feed(self) -> RankFeed | None:
        """What this engine asks of the trainer ranks that feed it rank by rank (after :meth:`listen`), or None
        when it takes one bucket per chunk from its source rank."""
        if self._forwarder is None:
            raise RuntimeError(f"rank_feed: engine {self.engine_index} is not listening yet (call listen() first)")
        return self._feed

    def _plan_feed(self, engine: SGLangEngine) -> RankFeed | None:
        slots = self.rank_slots
        if slots is None:
            return None
        if len(slots) != engine.tp_size:
            raise ValueError(f"engine {self.engine_index}: {len(slots)} rank slots for {engine.tp_size} TP ranks")
        nodes = list(dict.fromkeys(s.node for s in slots))
        if engine.load_mode != "streamed":
            if len(nodes) > 1:
                raise SGLangError(
                    f"engine {self.engine_index} spans nodes {nodes}, but its SGLang loads adapters in "
                    f"{engine.load_mode!r} mode (one bucket per version, made on the head node), whose CUDA IPC "
                    "handles the ranks on the other nodes cannot open: use the recipe's SGLang build (streamed "
                    "loading, each rank's payload from the trainer rank on its GPU) or engines of one node "
                    "(--rollout-tp-size)")
            return None
        return RankFeed(self.engine_index, slots, serialize_rank_payload, checksums=engine.verify_checksums)

    def error(self) -> str | None:
        return self._error

    # -- protocol passthrough (head only), every SGLang call on the engine thread
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        return self._on_engine_thread(self._head("generate").generate, requests, sampling)

    def adapter_version(self) -> int:
        return self._on_engine_thread(self._head("adapter_version").adapter_version)

    def adapter_report(self) -> dict[str, Any]:
        return self._on_engine_thread(self._head("adapter_report").adapter_report)

    def release_memory(self, tags: Sequence[str]) -> None:
        self._on_engine_thread(self._head("release_memory").release_memory, list(tags))

    def resume_memory(self, tags: Sequence[str]) -> None:
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


def _check_head_devices(engine_index: int, slots: tuple[RankSlot, ...], visible: Sequence[str] | None) -> None:
    """The head's ``CUDA_VISIBLE_DEVICES`` must list its node's engine ranks' GPUs in engine-rank order (SGLang's
    local rank ``j`` takes the ``j``-th): else engine rank ``i`` would not sit on its trainer rank's GPU."""
    if visible is None or not slots or any(s.gpu is None for s in slots):
        return
    head = [s for s in slots if s.node == slots[0].node]
    if [s.gpu for s in head] != [str(v) for v in visible]:
        raise ValueError(f"engine {engine_index}: the head's CUDA_VISIBLE_DEVICES {list(visible)} on node "
                         f"{slots[0].node} are not the GPUs {[s.gpu for s in head]} of its engine ranks "
                         f"0..{len(head) - 1} (trainer ranks {[s.rank for s in head]}), in order: SGLang's TP rank j "
                         "on that node would open payloads made on another GPU")
