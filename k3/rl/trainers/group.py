"""The trainer of a multi-rank ``--backend megatron`` run: one Ray actor per training rank (recipe §4.5, §5.4:
one trainer process per GPU), driven as one handle.

:class:`TrainerGroup` creates ``world_size`` :class:`TrainerRank` actors, rank ``r`` in the placement bundle of
training rank ``r`` (colocated with that rank's share of the rollout engines). Each rank gets the environment
torchrun would give it — ``MASTER_ADDR`` (127.0.0.1 when every rank is on rank 0's node, else rank 0's node IP
as Ray reports it), ``MASTER_PORT`` (a port rank 0 found free on its node), ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` — and then builds its ``TrainerWorker``, whose megatron policy joins the process group
(``k3.megatron.parallel.init_parallel``: NCCL on CUDA, gloo on CPU) and makes the TP/EP/PP/CP groups.

``LOCAL_RANK`` is the CUDA device index the rank uses *in its own process*: its position among the ranks on its
node when the process sees all the node's GPUs (torchrun's meaning), and 0 when Ray made only the bundle's GPU
visible to it (Ray's default, ``CUDA_VISIBLE_DEVICES`` per actor). On CPU it is the position on the node.

``call(method, *args)`` runs ``TrainerWorker.method`` on every rank at once (the megatron policy's methods are
collective: every rank must run them) and returns the results in rank order. The first rank to fail — an
exception, or a process that died — ends the wait at once with :class:`TrainerRankError` naming that rank; the
other ranks, possibly blocked in a collective on the failed one, are not waited for (the run's placement kills
them when it shuts down).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from k3.rl.errors import TrainingError, last_line
from k3.rl.grpo import GRPOConfig
from k3.rl.trainer_worker import TrainerWorker
from k3.settings.worker import WorkerSpec
from k3.transport.device_memory import DeviceMemoryError, is_out_of_memory, memory_note

__all__ = ["RANKS_KEY", "TrainerGroup", "TrainerRank", "TrainerRankError", "is_trainer_group", "local_ranks",
           "merge_rank_states", "split_rank_states"]

# The optimizer state of a multi-rank run holds one state per rank under this key (world size 1: flat).
RANKS_KEY = "ranks"


class TrainerRankError(TrainingError):
    """A trainer rank failed (raised, died, or did not answer in time); the message names the rank."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


# ------------------------------------------------------------------------------------------------ one rank
class TrainerRank:
    """One training rank as a Ray actor: the torchrun-style environment, then this rank's ``TrainerWorker``.

    The constructor only records the rank; :meth:`setup` (run on every rank at once, since joining the process
    group blocks until all have joined) builds the worker; :meth:`run` calls one of its methods."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank}: expected 0 <= rank < world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None

    def node_ip(self) -> str:
        """The IP of this actor's node, as Ray knows it."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's pick for ``MASTER_PORT``)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup(self, master_addr: str, master_port: int, node_local_rank: int, spec: WorkerSpec, grpo: GRPOConfig,
              max_tokens_per_micro_batch: int) -> int:
        """Set this rank's torchrun-style environment and build its ``TrainerWorker`` (which joins the process
        group: collective over all ranks). Returns the process id."""
        os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(int(master_port)), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(_device_index(node_local_rank)))
        self.worker = TrainerWorker(spec, grpo, max_tokens_per_micro_batch, rank=self.rank)
        return os.getpid()

    def run(self, method: str, *args: Any) -> Any:
        """``TrainerWorker.method(*args)`` on this rank."""
        if self.worker is None:
            raise RuntimeError(f"trainer rank {self.rank}: {method}() before setup()")
        try:
            return getattr(self.worker, method)(*args)
        except Exception as e:
            if is_out_of_memory(e):  # say how full the device was: the error itself rarely does
                raise DeviceMemoryError(f"out of device memory ({type(e).__name__}: {last_line(e)}); "
                                        f"{memory_note(self.worker.spec.device)}") from e
            raise

    def has(self, method: str) -> bool:
        return self.worker is not None and callable(getattr(self.worker, method, None))


def _device_index(node_local_rank: int) -> int:
    """The CUDA device this rank uses in its process (see the module docstring); the node-local rank on CPU."""
    if not torch.cuda.is_available():
        return node_local_rank
    return node_local_rank if torch.cuda.device_count() > node_local_rank else 0


def local_ranks(node_ips: Sequence[str]) -> list[int]:
    """Each rank's position among the ranks on its node: ``["a", "a", "b", "a"]`` → ``[0, 1, 0, 2]``."""
    seen: dict[str, int] = {}
    out = []
    for ip in node_ips:
        out.append(seen.get(ip, 0))
        seen[ip] = out[-1] + 1
    return out


# ------------------------------------------------------------------------------------------------ the group
class TrainerGroup:
    """``world_size`` trainer ranks driven as one handle (see the module docstring).

    ``actors[r]`` is rank ``r``'s Ray actor handle; it needs ``run(method, *args)`` and ``has(method)``
    (:class:`TrainerRank`). ``timeout_s`` bounds every call (None: no bound beyond the ranks' own collective
    timeouts: a rank that fails or dies ends the wait at once either way)."""

    FAILURE_GRACE_S = 3.0  # how long a failure waits for the other ranks' outcome (for the message only)

    def __init__(self, actors: Sequence[Any], timeout_s: float | None = None) -> None:
        if not actors:
            raise ValueError("a trainer group needs at least one rank")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (or None)")
        self.actors = list(actors)
        self.timeout_s = timeout_s

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @classmethod
    def start(cls, placement: Any, world_size: int, spec: WorkerSpec, grpo: GRPOConfig,
              max_tokens_per_micro_batch: int, *,
              timeout_s: float | None = None) -> "TrainerGroup":
        """Create rank ``r``'s :class:`TrainerRank` in ``placement``'s bundle of training rank ``r`` for every
        ``r < world_size``, give each its torchrun environment and build every rank's ``TrainerWorker`` (all at
        once). A rank that fails to build raises :class:`TrainerRankError` naming it."""
        import ray

        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        remote = ray.remote(TrainerRank)
        actors = [placement.create_actor(remote, r, "trainer", r, world_size) for r in range(world_size)]
        group = cls(actors, timeout_s=timeout_s)
        ips = group._wait([a.node_ip.remote() for a in actors], "node_ip")
        master = "127.0.0.1" if len(set(ips)) == 1 else ips[0]
        port = group._wait([actors[0].free_port.remote()], "free_port")[0]
        local = local_ranks(ips)
        group._wait([a.setup.remote(master, port, local[r], spec, grpo, max_tokens_per_micro_batch)
                     for r, a in enumerate(actors)], "setup (building the megatron policy)")
        return group

    # -- calls
    def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank at once; the results in rank order."""
        return self.call_each([(method, args)] * self.world_size)

    def call_each(self, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Rank ``r`` runs ``calls[r] = (method, args)``, all ranks at once; the results in rank order."""
        if len(calls) != self.world_size:
            raise ValueError(f"call_each: {len(calls)} calls for {self.world_size} ranks")
        refs = [a.run.remote(method, *args) for a, (method, args) in zip(self.actors, calls)]
        methods = {m for m, _ in calls}
        return self._wait(refs, methods.pop() if len(methods) == 1 else "/".join(sorted(methods)))

    def has(self, method: str) -> bool:
        return bool(self._wait([self.actors[0].has.remote(method)], "has")[0])

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        """Results of ``refs`` (``refs[i]`` from rank ``i``, or from rank 0 when there is one ref) in order,
        ending at the first failed rank (:class:`TrainerRankError`) without waiting for the rest beyond
        ``FAILURE_GRACE_S``: a rank that died makes its peers' collectives fail too, often first, so the ones
        failing within the grace are collected and a dead rank, the likely cause, is named first."""
        import ray

        pending = {ref: k for k, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                late = sorted(pending.values())
                raise TrainerRankError(f"trainer rank{'s' if len(late) > 1 else ''} {_ranks(late)} did not finish "
                                       f"{what} within {self.timeout_s:g} s", rank=late[0])
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - Ray wraps the rank's own error; its type and text matter
                    raise self._failure(what, {rank: e}, pending) from e
        return results

    def _failure(self, what: str, failed: dict[int, BaseException], pending: dict[Any, int]) -> TrainerRankError:
        import ray

        if pending:  # the others' outcome within the grace: a peer that died is the likelier cause
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.FAILURE_GRACE_S)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - collected for the message
                    failed[pending[ref]] = e
        died = sorted(r for r, e in failed.items() if isinstance(e, ray.exceptions.RayActorError))
        order = died + sorted(r for r in failed if r not in died)
        parts = []
        for r in order:
            e = failed[r]
            if r in died:
                parts.append(f"trainer rank {r} died during {what} ({type(e).__name__}: {last_line(e)})")
            else:
                cause = getattr(e, "cause", None) or e
                parts.append(f"trainer rank {r} failed in {what}: {type(cause).__name__}: {last_line(cause)}")
        return TrainerRankError("; ".join(parts), rank=order[0])

    def kill(self) -> None:
        """Kill every rank's actor (a placement's shutdown does this too)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor that is gone already is what we want
                pass


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def is_trainer_group(trainer: Any) -> bool:
    """Whether ``trainer`` is a trainer group (one handle over several ranks, ``call`` returns a list per rank)
    rather than the handle of a one-rank trainer."""
    return hasattr(trainer, "call_each") and hasattr(trainer, "world_size")


# ------------------------------------------------------------------------------------------------ optimizer state
def merge_rank_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer state for the checkpoint from every rank's (each holds its own shards): world size 1 keeps
    the rank's flat state (the one-rank format); more ranks keep rank 0's tags (backend, layout, steps) and
    every rank's state, in rank order, under ``"ranks"``."""
    if not states:
        raise ValueError("merge_rank_states: no rank states")
    if len(states) == 1:
        return dict(states[0])
    head = states[0]
    return {"backend": head.get("backend"), "parallel": head.get("parallel"), "dp": head.get("dp"),
            "steps": head.get("steps"), "world_size": len(states), RANKS_KEY: list(states)}


def split_rank_states(state: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The per-rank states of ``merge_rank_states(...)`` for a run of ``world_size`` ranks; raises ``ValueError``
    when the checkpoint was saved by a different number of ranks."""
    ranks = state.get(RANKS_KEY)
    saved = 1 if ranks is None else len(ranks)
    if saved != world_size:
        raise ValueError(f"the optimizer state was saved by {saved} trainer rank{'s' if saved > 1 else ''}; this "
                         f"run has {world_size}: resume with the same layout")
    return [state] if ranks is None else list(ranks)
