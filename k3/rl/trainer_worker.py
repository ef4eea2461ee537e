"""The trainer's worker of one training rank: the policy (torch or megatron backend) with its optimizer, and the
producing end of the adapter hand-off, with leak accounting around every sync. A plain class: the loop runs it
in process or as a Ray actor (one per training rank under megatron: ``k3.rl.trainers.group``), colocated with the
rollout engine that rank feeds.

Adapter sync goes trainer → engine over a ``multiprocessing`` connection (a Unix socket the engine listens on):
the ``AdapterProducer`` here sends one flattened bucket per chunk (shared memory on CPU, CUDA IPC on GPU) and
waits for the engine's ack; the engine activates a version only when it is complete. An engine fed rank by rank
(SGLang, recipe §4.5: ``join_rank_feeds``) takes from every trainer rank on its GPUs that rank's own payload of
each chunk (``k3.transport.fed_producer``): the ranks gather them to the source over a Gloo group, the source
hands them to the engine, and every rank frees its bucket only after the engine's answer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch

from k3.lora.digest import chunk_digest
from k3.lora.export import export_chunks, load_peft_adapter, save_peft_adapter
from k3.rl.grpo import GRPOConfig, load_torch_optimizer_state, optimizer_kind
from k3.rl.replicas import replica_digests
from k3.rl.step_memory import record_step_memory, write_step_memory
from k3.rl.step_profile import PROFILED_STEP, profile_call, write_profile
from k3.rl.trainers.megatron import build_megatron_policy
from k3.rl.trainers.memory_regions import TrainerMemory, TrainerMemoryError, resident_bytes, trainer_regions
from k3.rl.trainers.torch import PolicyTrainer
from k3.rl.trainers.trajectory import Trajectory
from k3.rollout.lora_model import load_lora_model
from k3.settings.train import BACKENDS
from k3.settings.worker import WorkerSpec
from k3.tokenizer import load_tokenizer
from k3.transport.device_memory import GIB, memory_reading, physical_bytes
from k3.transport.fed_producer import FedProducer
from k3.transport.feed_group import join_feeds
from k3.transport.handoff import AdapterProducer, HandoffError, TransferBuffer
from k3.transport.leakcheck import LeakCheck, release_freed_heap
from k3.transport.memory_cap import apply_gpu_memory_cap
from k3.transport.rank_feed import RankFeed, this_gpu, this_node

__all__ = ["TrainerWorker"]


class TrainerWorker:
    """Policy + optimizer + the producing end of the hand-off, with leak accounting around every sync."""

    def __init__(self, spec: WorkerSpec, grpo: GRPOConfig, max_tokens_per_micro_batch: int, rank: int = 0) -> None:
        self.spec = spec
        self.rank = rank
        # Before anything is allocated: every later allocation of this rank counts against the cap.
        capped = apply_gpu_memory_cap(_rank_device(spec), f"trainer rank {rank}",
                                      fraction=spec.gpu_memory_fraction_per_actor, gb=spec.gpu_memory_gb_per_actor)
        if capped:
            print(capped, flush=True)
        self.tokenizer = load_tokenizer(spec.model_dir)
        self._megatron = spec.backend == "megatron"
        # --offload-train: the policy is built inside the trainer's memory regions (memory_regions)
        regions = trainer_regions(spec.offload_train, spec.device)
        if self._megatron:
            self.policy = build_megatron_policy(
                spec.model_dir, spec.lora, self.tokenizer.pad_id, grpo, max_tokens_per_micro_batch,
                layout=spec.layout, ref_load=spec.ref_load, dtype=getattr(torch, spec.dtype), seed=spec.seed,
                expert_lora_kernel=spec.expert_lora_kernel, use_dynamic_batch_size=spec.use_dynamic_batch_size,
                recompute_granularity=spec.recompute_granularity, recompute_method=spec.recompute_method,
                recompute_num_layers=spec.recompute_num_layers, use_distributed_optimizer=spec.use_distributed_optimizer,
                optimizer_cpu_offload=spec.optimizer_cpu_offload,
                optimizer_offload_fraction=spec.optimizer_offload_fraction,
                check_for_nan_in_loss_and_grad=spec.check_for_nan_in_loss_and_grad,
                distributed_timeout_minutes=spec.distributed_timeout_minutes,
                log_probs_chunk_size=spec.log_probs_chunk_size, regions=regions)
        elif spec.backend == "torch":
            _refuse_megatron_only(spec)
            with regions.params() if regions is not None else contextlib.nullcontext():
                model = load_lora_model(spec)
            self.policy = PolicyTrainer(model, pad_id=self.tokenizer.pad_id, grpo=grpo,
                                        max_tokens_per_micro_batch=max_tokens_per_micro_batch, device=spec.device,
                                        log_probs_chunk_size=spec.log_probs_chunk_size,
                                        check_for_nan_in_loss_and_grad=spec.check_for_nan_in_loss_and_grad, rank=rank)
        else:
            raise ValueError(f"WorkerSpec.backend={spec.backend!r}: expected one of {BACKENDS}")
        self.memory = (None if regions is None else
                       TrainerMemory(regions, self.policy.model, self.policy.grad_buffers(), spec.device, rank))
        self.leak = LeakCheck(device=spec.device)
        self._syncs = 0
        self._producer = None
        self._export_only = False

    def export_only(self) -> None:
        """This rank feeds no engine (recipe §4.5: only the first rank on each engine's GPUs sends): its
        ``update_weights`` still runs the export, which is collective over TP/EP/PP, and drops every chunk."""
        if not self._megatron:
            raise RuntimeError("export_only() is for the megatron backend's ranks; a torch trainer feeds its engine")
        self._export_only = True

    def connect(self, address: str, authkey: bytes, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                conn = Client(address, family="AF_UNIX", authkey=authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._producer = AdapterProducer(conn, transfer_buffer=self._transfer_buffer(), on_bucket=self.leak.track,
                                         same_process=_peer_pid(conn) == os.getpid())
        self._export_only = False

    def _transfer_buffer(self) -> TransferBuffer | None:
        # The export is BF16 (the serving contract); the buffer stays allocated across syncs by design, so the leak
        # gate sees it in its baseline and tracks only fresh buckets.
        return TransferBuffer(self.spec.device, torch.bfloat16) if self.spec.transfer_buffer else None

    def join_rank_feeds(self, feeds: Sequence[RankFeed]) -> None:
        """Join the engines fed rank by rank (recipe §4.5); collective over every trainer rank, after
        :meth:`connect` / :meth:`export_only`. Every rank creates every feed's Gloo group; a rank in a feed checks
        that it runs on its engine rank's node and GPU, and from then on sends its own payload of every chunk
        (``FedProducer``): the source through the connection :meth:`connect` opened, the others through the
        source. A rank in no feed keeps what it had."""
        group = join_feeds(feeds, self.rank, this_node(), this_gpu(self.spec.device),
                           timeout=_feed_group_timeout(self.spec))
        if group is None:
            return
        conn, same_process = None, False
        if group.is_source:
            if self._producer is None:
                raise RuntimeError(f"trainer rank {self.rank} is the source of engine {group.feed.engine_index}'s "
                                   "feed but has no connection to it: connect() first")
            conn, same_process = self._producer.conn, self._producer.same_process
        buffer = self._producer.transfer_buffer if self._producer is not None else self._transfer_buffer()
        self._producer = FedProducer(conn, group, chunk_digest, transfer_buffer=buffer, on_bucket=self.leak.track,
                                     same_process=same_process)
        self._export_only = False

    # -- memory (--offload-train; recipe §5.1, §5.3: k3.rl.trainers.memory_regions)
    def sleep(self) -> list[dict[str, Any]]:
        """Drop the gradient buffers and pause the parameters; the ``before/after_offload`` readings ([] when
        already asleep)."""
        return self._regions("sleep").sleep()

    def wake_up(self) -> list[dict[str, Any]]:
        """Resume the parameters and the gradient buffers (zeroed), all or nothing; the ``before/after_wake_up``
        readings ([] when awake)."""
        return self._regions("wake_up").wake_up()

    def offload_grad_buffer(self) -> list[dict[str, Any]]:
        """Drop only the gradient buffers (the ``gpu`` peak order); the ``before/after_offload_grad_buffer``
        readings ([] when already dropped)."""
        return self._regions("offload_grad_buffer").offload_grad_buffer()

    def clear_memory(self) -> list[dict[str, Any]]:
        """Free what nothing references any more (the recipe's ``clear_memory``); no readings."""
        self._regions("clear_memory").clear_memory()
        return []

    def device_memory(self) -> dict[str, Any]:
        """This rank's device as a memory reading without a phase: ``memory/physical_gb`` (CUDA: the whole device,
        every process on it; CPU: this process's RSS). The loop's reading of an engine that cannot report its own."""
        return {"device": self.spec.device, "memory/physical_gb": physical_bytes(self.spec.device) / GIB}

    def _regions(self, what: str) -> TrainerMemory:
        if self.memory is None:
            raise TrainerMemoryError(f"trainer rank {self.rank}: {what}() without --offload-train: this trainer "
                                     "keeps its memory resident and has no regions to move", self.rank, what)
        return self.memory

    def _awake(self, what: str) -> None:
        """Refuse ``what`` while the parameters or gradient buffers are away (a schedule bug, which on CUDA would
        otherwise read unmapped memory)."""
        if self.memory is not None:
            self.memory.check_awake(what)

    def _adapters_readable(self):
        """The adapters readable for the export, asleep or awake (``TrainerMemory.readable``)."""
        return contextlib.nullcontext() if self.memory is None else self.memory.readable()

    def _reading(self, phase: str) -> dict[str, Any]:
        """A ``memory`` reading of this rank (CPU: ``memory/allocated_gb`` is the resident parameter and
        gradient-buffer bytes)."""
        if self.memory is not None:
            return self.memory.reading(phase)
        resident = resident_bytes([*self.policy.model.parameters(), *self.policy.grad_buffers().tensors()])
        return memory_reading(phase, self.spec.device, resident, rank=self.rank)

    # -- GRPO
    def log_probs(self, trajs: list[Trajectory]) -> list[list[float]]:
        self._awake("log_probs")
        return self.policy.log_probs(trajs)

    def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        self._awake("train_step")
        profiled, step = self.spec.profile_train_step, self.policy.steps
        if profiled is None or step not in (profiled, profiled + 1):
            return self.policy.train_step(trajs)
        title = f"optimizer step {step}, trainer rank {self.rank}, {len(trajs)} samples"
        if step == profiled:  # where its time goes
            stats, summary = profile_call(lambda: self.policy.train_step(trajs))
            where = write_profile(summary, Path(self.spec.profile_dir), f"train_step_{step}_rank{self.rank}", title)
        else:  # what the next step leaves allocated: never under the profiler (k3.rl.step_memory says why)
            stats, left = record_step_memory(lambda: self.policy.train_step(trajs))
            if left is None:  # no CUDA: no allocator to read
                return stats
            where = write_step_memory(left, Path(self.spec.profile_dir),
                                      f"train_step_{step}_memory_rank{self.rank}", title)
        print(f"trainer rank {self.rank}: optimizer step {step} profiled: {where}", flush=True)
        return {**stats, PROFILED_STEP: float(step)}  # the harness leaves this cycle's time out

    def replica_digests(self) -> dict[str, Any]:
        """After an optimizer step: ``{"rank", "step", "digests": {label: digest}}`` of every adapter tensor this
        rank holds (``k3.rl.replicas``); ranks that hold replicas of a tensor give it the same label."""
        self._awake("replica_digests")
        return {"rank": self.rank, "step": int(self.policy.steps), "digests": replica_digests(self.policy.model)}

    # -- sync
    def update_weights(self, version: int) -> dict[str, Any]:
        """Export every adapter chunk of ``version`` and hand them to the engine (a rank set to
        :meth:`export_only` drops them); memory is sampled before and after (the harness's
        ``returns_to_baseline``). Returns timings, chunk count, the memory records and ``chunk_digests``: the
        ``k3.lora.digest.chunk_digest`` of each chunk as sent, in order (what the engine must report back)."""
        if self._producer is None and not self._export_only:
            raise RuntimeError("update_weights before connect(): the engine's adapter socket is not open")
        before = self._reading("before_update_weights")
        t0 = time.perf_counter()
        n = 0
        digests: list[str] = []  # per chunk, of what is sent: the engine must report the same for what it activated

        # Each chunk is exported straight into the bucket (or transfer buffer) it travels in: no staging copy.
        into = None if self._producer is None else self._producer.bucket_for
        fed = isinstance(self._producer, FedProducer)  # it digests each chunk itself, next to its payload

        def counted():
            nonlocal n
            chunks = (self.policy.export_chunks(version, device=self.spec.device, out=into) if self._megatron
                      else export_chunks(self.policy.model, version, device=self.spec.device, out=into))
            for chunk in chunks:
                n += 1
                if not fed:
                    digests.append(chunk_digest(chunk.tensors))
                yield chunk

        if self._producer is None:  # export_only: run the collective stream to its end, send nothing
            with self._adapters_readable():
                for chunk in counted():
                    del chunk  # one chunk held at a time
            return self._sync_result(version, n, t0, before, active_version=None, fed=False, digests=digests)
        try:
            with self._adapters_readable():  # asleep (--offload-train): the exporter reads the backed-up adapters
                ack = self._producer.send_version(counted())
        except HandoffError:
            # The engine went away mid-version: free the buckets it can no longer release, then fail the run
            # (--resume continues from the last adapter checkpoint).
            if hasattr(self._producer, "discard_after_receiver_exit"):
                self._producer.discard_after_receiver_exit()
            self._producer = None
            raise
        if not ack.ok:
            raise RuntimeError(f"the engine rejected adapter version {version}: {ack.error}")
        if fed:
            digests = list(self._producer.version_digests)
        return self._sync_result(version, n, t0, before, active_version=ack.active_version, fed=True,
                                 digests=digests)

    def _sync_result(self, version: int, n: int, t0: float, before: dict[str, Any],
                     active_version: int | None, fed: bool, digests: list[str] | None = None) -> dict[str, Any]:
        elapsed = time.perf_counter() - t0
        # Two warm-up syncs: the startup one, and the first after a train step (the optimizer allocates its state,
        # and Megatron its grad buffers, on the first step: measured +65.55 MiB CUDA for the tiny model on the
        # H200). The end of the second is the baseline every later sync must return to.
        if self._syncs < 2:
            self.leak.set_baseline()
            problems = []
        else:
            problems = self.leak.end_sync()
        self._syncs += 1
        after = self._reading("after_update_weights")
        # The sync's cleanup (the recipe's "after update_weights process-group cleanup"; no group is torn down here,
        # memory_regions says why): cached blocks back to the device, freed heap back to the OS.
        if torch.device(self.spec.device).type == "cuda":
            torch.cuda.empty_cache()
        release_freed_heap()
        cleanup = self._reading("after_update_weights_cleanup")
        return {"version": version, "chunks": n, "perf/update_weights_time": elapsed,
                "memory": [before, after, cleanup], "engine_active_version": active_version,
                "fed_engine": fed, "leak_problems": list(problems), "chunk_digests": list(digests or [])}

    # -- adapter checkpoints
    def save_adapter(self, directory: str) -> str:
        with self._adapters_readable():  # the loop saves after the sync, with the trainer asleep
            if self._megatron:
                return str(self.policy.save_adapter(directory, base_model_name_or_path=self.spec.model_dir))
            return str(save_peft_adapter(self.policy.model, directory, base_model_name_or_path=self.spec.model_dir))

    def load_adapter(self, directory: str) -> None:
        self._awake("load_adapter")
        if self._megatron:
            self.policy.load_adapter(directory)
        else:
            load_peft_adapter(self.policy.model, directory)

    def optimizer_state(self) -> dict[str, Any]:
        if self._megatron:
            return self.policy.optimizer_state()
        return {"backend": "torch", "optimizer_kind": optimizer_kind(self.policy.optimizer),
                "optimizer": self.policy.optimizer.state_dict(), "steps": self.policy.steps}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._awake("load_optimizer_state")
        if self._megatron:
            self.policy.load_optimizer_state(state)
            return
        if state.get("backend", "torch") != "torch":  # untagged states predate the tag: the torch backend's
            raise ValueError(f"the optimizer state was saved by the {state['backend']} backend; this run trains "
                             "with --backend torch: resume with the run's backend, or start a new run")
        # untagged states predate SGD: Adam's; the other optimizer's state is refused, the run's hyperparameters kept
        load_torch_optimizer_state(self.policy.optimizer, state["optimizer"], state.get("optimizer_kind", "adam"))
        self.policy.steps = int(state["steps"])

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._megatron:
            self.policy.close()


def _rank_device(spec: WorkerSpec) -> str:
    """The device this rank allocates on: a megatron rank's ``cuda:LOCAL_RANK`` (``k3.megatron.parallel`` sets it
    current from that variable), else the spec's."""
    if spec.device == "cuda" and spec.backend == "megatron":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return spec.device


def _refuse_megatron_only(spec: WorkerSpec) -> None:
    """The torch backend trains one rank with a plain torch optimizer: the megatron optimizer's settings set in
    ``spec`` would be printed and never applied, so they are refused (one line naming them)."""
    set_ = [f"{name}={getattr(spec, name)!r}" for name, off in (("use_distributed_optimizer", False),
                                                                 ("optimizer_cpu_offload", False),
                                                                 ("optimizer_offload_fraction", 0.0))
            if getattr(spec, name) != off]
    if set_:
        raise ValueError(f"{', '.join(set_)}: only the megatron backend applies these (the torch backend trains one "
                         "rank with a plain torch optimizer); use --backend megatron, or leave them off")


def _feed_group_timeout(spec: WorkerSpec) -> timedelta:
    """The collective timeout of the rank feeds' Gloo groups: the run's ``distributed_timeout_minutes``, as every
    other process group of the run."""
    return timedelta(minutes=float(spec.distributed_timeout_minutes))


def _peer_pid(conn: Connection) -> int | None:
    """The pid of the process at the other end of an AF_UNIX connection (Linux ``SO_PEERCRED``), else None."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return None
    with sock:
        try:
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
        except (OSError, AttributeError):
            return None
    return pid
