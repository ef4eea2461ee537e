"""The trainer's memory while the engines generate: its regions, and ``sleep`` / ``wake_up`` /
``offload_grad_buffer`` (recipe §5.1, §5.3; ``--offload-train``).

**CUDA** (torch_memory_saver 0.0.10, hook mode ``"torch"``: a pluggable allocator inside ``region()``, no
``LD_PRELOAD``). The policy is *built* inside two regions (:class:`SaverRegions`):

* ``"default"`` (:data:`PARAMS_TAG`), with CPU backup: every parameter, the frozen base and the adapters. The
  adapters' parameter buffers stay here, backed up, because the exporter reads them while the trainer sleeps
  (:meth:`TrainerMemory.readable`: each adapter's CPU backup, zero-copy, copied to a fresh device tensor for the
  export — the recipe's ``--disable-weights-backuper``: no separate host weight copy, the weight getter reads the
  memory saver's backups).
* ``"grad_buffer"`` (:data:`GRAD_BUFFER_TAG`), without backup: megatron's DDP gradient buffers, discarded on pause
  and re-zeroed on resume. (The torch backend has no persistent gradient buffer: its ``.grad`` tensors are dropped
  and autograd makes new ones at the next backward.)

Anything allocated outside a region — the optimizer (fp32 main copies, Adam moments), activations, the export's
chunk buckets, the transfer buffer — is the ordinary allocator's and stays resident. That is why the sync needs no
``torch_memory_saver.disable()`` here: in the recipe's ``LD_PRELOAD`` mode every allocation is the saver's unless
disabled; in hook mode ``"torch"`` only allocations inside ``region()`` are.

``sleep()``: clear memory (``gc``, the CUDA cache, the host heap), pause ``grad_buffer`` (unless
``offload_grad_buffer`` did), pause ``default``. ``wake_up()``: resume ``default``, then ``grad_buffer`` (re-zeroed),
clear memory. Paused memory keeps its virtual allocation: ``torch.cuda.memory_allocated`` stays at the footprint
while the device's physical use (total − free) drops — the memory events log both (``k3.transport.device_memory``).

Process groups: the recipe also destroys its reloadable NCCL groups on sleep and re-creates them on wake and around
``update_weights`` (their communicator buffers, a few hundred MB per GPU at scale). Every NCCL group here (the world
and megatron's TP/EP/PP/CP/DP groups) is needed by training *and* by the adapter export (collective over TP/EP/PP),
none only for the sync, so none is torn down: they stay across sleep, and their memory is part of what the events
show. On CPU every group is gloo; the tests check that they work after a wake.

**CPU** (:class:`HostRegions`; no memory saver): the same steps are real moves, not no-ops. ``sleep`` moves every
frozen parameter to a host backup (its ``.data`` becomes an empty tensor; the bytes live in the backup, the way the
saver's ``default`` region keeps its CPU backup) and drops the gradient buffers (megatron's DDP: its own
``offload_grad_buffers``, storage resized to 0, views kept; torch: ``.grad`` set to None); ``wake_up`` puts them
back, bit for bit, gradients re-zeroed. The adapters stay where they are, so the exporter reads them as they are.
:func:`resident_bytes` (parameters and gradient buffers that are materialised) is then the CPU run's
``memory/allocated_gb``: it falls during sleep and comes back on wake.

State flags make every step idempotent (the recipe's ``_train_offloaded`` / ``_grad_buffer_offloaded``). A
``wake_up`` that fails midway puts back to sleep what it had resumed, so nothing is ever half-resumed, and raises
:class:`TrainerMemoryError` naming the rank and the step; if even that fails the trainer is marked broken and refuses
every later call. A ``sleep`` that fails midway is undone the same way (back to fully awake).
"""

from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ContextManager

import torch
from torch import nn

from k3.transport.device_memory import default_pool_usage, memory_reading
from k3.transport.leakcheck import release_freed_heap

__all__ = ["GRAD_BUFFER_TAG", "PARAMS_TAG", "SAVER_PIN", "GradBuffers", "HostRegions", "ParamGrads", "Regions",
           "SaverRegions", "TrainerMemory", "TrainerMemoryError", "load_memory_saver", "resident_bytes",
           "trainer_regions"]

PARAMS_TAG = "default"
GRAD_BUFFER_TAG = "grad_buffer"
SAVER_PIN = "torch-memory-saver==0.0.10"  # the gpu extra's pin (pyproject.toml)


class TrainerMemoryError(RuntimeError):
    """A trainer's sleep / wake_up failed, or a call found its memory in the wrong state; names rank and phase."""

    def __init__(self, message: str, rank: int, phase: str) -> None:
        super().__init__(message)
        self.rank, self.phase = rank, phase


def load_memory_saver() -> Any:
    """torch_memory_saver's singleton in hook mode ``"torch"`` (imported here only; set before its first use), left
    uninitialised: megatron-core sets the same hook mode when its inference contexts are imported (while the policy
    is built), and the saver refuses that setting once initialised ("no attribute '_impl_ctor_kwargs'"), so
    nothing here may touch a property that initialises it (``retain_cpu_backup`` does: :class:`SaverRegions` sets
    it at the first pause)."""
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        raise ImportError(f"--offload-train on a CUDA device needs torch_memory_saver: pip install '{SAVER_PIN}' "
                          "(the gpu extra: pip install 'k3-lora-rl[gpu]'), or pass --no-offload-train to keep "
                          "the trainer resident") from None
    if getattr(torch_memory_saver, "_impl", None) is None:  # the hook mode can be set only before first use
        torch_memory_saver.hook_mode = "torch"
    return torch_memory_saver


# ------------------------------------------------------------------------------------------------ regions
class Regions(ABC):
    """Where a trainer's memory is built: ``params()`` (every parameter) and ``grad_buffers()`` (DDP's gradient
    buffers) are context managers the policy allocates inside."""

    captures: bool  # allocations inside the contexts are the saver's (paused by tag), not ordinary ones

    @abstractmethod
    def params(self) -> ContextManager[None]: ...

    @abstractmethod
    def grad_buffers(self) -> ContextManager[None]: ...


class SaverRegions(Regions):
    """torch_memory_saver's regions (CUDA): ``saver`` is its singleton (:func:`load_memory_saver`) or a stand-in
    with the same ``region`` / ``pause`` / ``resume`` / ``get_cpu_backup``."""

    captures = True

    def __init__(self, saver: Any) -> None:
        self.saver = saver
        self.paused: set[str] = set()

    def params(self) -> ContextManager[None]:
        return self.saver.region(tag=PARAMS_TAG, enable_cpu_backup=True)

    def grad_buffers(self) -> ContextManager[None]:
        return self.saver.region(tag=GRAD_BUFFER_TAG, enable_cpu_backup=False)

    def pause(self, tag: str) -> None:
        """Pause ``tag`` unless it is paused (the saver ends the process on a second pause, or on resuming what
        is not paused)."""
        if tag not in self.paused:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # no kernel may still write memory that is about to be unmapped
            # The pinned CPU backups are kept across resumes: each pause copies into the host buffer the last one
            # made instead of pinning 12.6 GB anew (the first smoke-gpu run, H100, without retention: a sleep took
            # 6.6-7.1 s, a wake 2.1-2.8 s). Set here, not at load (load_memory_saver); setting it again is a no-op.
            self.saver.retain_cpu_backup = True
            self.saver.pause(tag)
            self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag in self.paused:
            self.saver.resume(tag)
            self.paused.discard(tag)

    def cpu_backup(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy of a paused tensor, zero-copy (a view of the saver's backup)."""
        backup = self.saver.get_cpu_backup(t, zero_copy=True)
        if backup is None:
            raise RuntimeError("torch_memory_saver holds no CPU backup of an adapter parameter (its region is not "
                               "paused, or was made without enable_cpu_backup)")
        return backup


class HostRegions(Regions):
    """The CPU analogue: nothing to capture (the contexts are empty); the moves are :class:`TrainerMemory`'s."""

    captures = False

    def params(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def grad_buffers(self) -> ContextManager[None]:
        return contextlib.nullcontext()


def trainer_regions(offload_train: bool, device: str | torch.device,
                    saver_loader: Callable[[], Any] = load_memory_saver) -> Regions | None:
    """The regions of a trainer on ``device``: None when ``offload_train`` is off (everything stays resident),
    torch_memory_saver's on CUDA (an ``ImportError`` saying what to install when it is missing), else the CPU
    analogue."""
    if not offload_train:
        return None
    if torch.device(device).type == "cuda":
        return SaverRegions(saver_loader())
    return HostRegions()


# ------------------------------------------------------------------------------------------------ gradients
class GradBuffers(ABC):
    """A policy's gradient buffers as sleep sees them (each backend has its own)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the buffers now (for :func:`resident_bytes`)."""

    @abstractmethod
    def release(self, regions: Regions) -> None:
        """Drop the buffers' memory (their contents are lost)."""

    @abstractmethod
    def restore(self, regions: Regions) -> None:
        """Give the buffers memory again, zeroed (a no-op where nothing was kept)."""


class ParamGrads(GradBuffers):
    """Plain ``.grad`` tensors of ``params`` (the torch backend): released by dropping them (autograd makes zeroed
    ones at the next backward, as after ``zero_grad(set_to_none=True)``), so there is nothing to restore."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)

    def tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def release(self, regions: Regions) -> None:
        for p in self.params:
            p.grad = None

    def restore(self, regions: Regions) -> None:
        pass


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` that are materialised now (a storage moved away or resized
    to 0 counts 0; one shared by several tensors counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------ sleep / wake
class TrainerMemory:
    """``sleep`` / ``wake_up`` / ``offload_grad_buffer`` of one trainer rank (module docstring).

    ``model``: the module whose parameters the regions hold (frozen ones: ``requires_grad`` False; adapters: True);
    ``grads``: its gradient buffers; ``device``: where it trains; ``rank``: named in errors and readings. Every
    step returns its ``memory`` readings (before/after, ``k3.transport.device_memory.memory_reading``), or
    ``[]`` when the state was already the one asked for."""

    def __init__(self, regions: Regions, model: nn.Module, grads: GradBuffers, device: str | torch.device,
                 rank: int = 0) -> None:
        self.regions, self.model, self.grads = regions, model, grads
        self.device = torch.device(device)
        self.rank = rank
        self.asleep = False  # the recipe's _train_offloaded
        self.grads_offloaded = False  # the recipe's _grad_buffer_offloaded
        self._params_paused = False  # the parameters' move (apart from asleep: a failed sleep or wake undoes it)
        self.broken: str | None = None
        self._host: dict[nn.Parameter, torch.Tensor] = {}  # CPU analogue: frozen parameter -> its host copy
        self._frozen = _movable_frozen(model)
        self._adapters = _unique(p for p in model.parameters() if p.requires_grad)

    # -- what the worker asks
    def resident_bytes(self) -> int:
        """Parameters and gradient buffers materialised now (the CPU run's ``memory/allocated_gb``)."""
        return resident_bytes([*self.model.parameters(), *self.grads.tensors()])

    def reading(self, phase: str) -> dict[str, Any]:
        """The memory event of ``phase``; on CUDA with the saver's regions, also what lies outside them
        (``default_pool_usage``: what a sleep leaves on the device)."""
        record = memory_reading(phase, self.device, self.resident_bytes(), rank=self.rank)
        if self.regions.captures and self.device.type == "cuda":
            record.update(default_pool_usage(self.device))
        return record

    def check_awake(self, what: str) -> None:
        """Raise :class:`TrainerMemoryError` unless the parameters and gradient buffers are all in place."""
        self._check_not_broken(what)
        if self.asleep or self.grads_offloaded:
            state = "asleep" if self.asleep else "without its gradient buffers (offload_grad_buffer)"
            raise TrainerMemoryError(f"trainer rank {self.rank}: {what} while the trainer is {state}: the loop "
                                     "must wake_up the trainer first", self.rank, what)

    # -- the steps
    def sleep(self) -> list[dict[str, Any]]:
        """Clear memory, drop the gradient buffers (unless already), pause the parameters (module docstring)."""
        self._check_not_broken("sleep")
        if self.asleep:
            return []
        records = [self.reading("before_offload")]
        grads_before = self.grads_offloaded
        step = "clearing memory"
        try:
            self.clear_memory()
            step = "dropping the gradient buffers"
            self._release_grads()
            step = "pausing the parameters"
            self._pause_params()
        except BaseException as e:
            # back to the state before the call: parameters in place, gradient buffers as they were
            self._undo("sleep", step, e, lambda: (self._resume_params(),
                                                  None if grads_before else self._restore_grads()),
                       "left awake, as before the call")
        self.asleep = True
        records.append(self.reading("after_offload"))
        return records

    def wake_up(self) -> list[dict[str, Any]]:
        """Resume the parameters, then the gradient buffers (zeroed), clear memory; all or nothing."""
        self._check_not_broken("wake_up")
        if not self.asleep:
            return []
        records = [self.reading("before_wake_up")]
        step = "resuming the parameters"
        try:
            self._resume_params()
            step = "resuming the gradient buffers"
            self._restore_grads()
            step = "clearing memory"
            self.clear_memory()
        except BaseException as e:
            self._undo("wake_up", step, e, lambda: (self._release_grads(), self._pause_params()),
                       "back asleep, nothing half-resumed")
        self.asleep = False
        records.append(self.reading("after_wake_up"))
        return records

    def offload_grad_buffer(self) -> list[dict[str, Any]]:
        """Drop only the gradient buffers (the ``gpu`` peak order, before the engine's weights come back)."""
        self._check_not_broken("offload_grad_buffer")
        if self.grads_offloaded:
            return []
        records = [self.reading("before_offload_grad_buffer")]
        try:
            self._release_grads()
        except BaseException as e:
            self._undo("offload_grad_buffer", "dropping the gradient buffers", e, self._restore_grads,
                       "left with its gradient buffers, as before the call")
        records.append(self.reading("after_offload_grad_buffer"))
        return records

    def clear_memory(self) -> None:
        """Free what is no longer referenced: Python cycles, the CUDA cache, the host heap (the recipe's
        ``clear_memory``)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        release_freed_heap()

    @contextlib.contextmanager
    def readable(self) -> Iterator[None]:
        """The adapters readable for the export while the trainer sleeps. CPU: they never moved. CUDA: each
        adapter's ``.data`` points at a fresh device copy of its saver backup for the duration, then back at the
        paused original (the backups are current: they were taken at the pause, after the last step)."""
        self._check_not_broken("reading the adapters")
        if not self._params_paused or not self.regions.captures:
            yield
            return
        saved: list[tuple[nn.Parameter, torch.Tensor]] = []
        try:
            for p in self._adapters:
                if not p.data.is_contiguous():
                    raise TrainerMemoryError(f"trainer rank {self.rank}: an adapter parameter of shape "
                                             f"{tuple(p.shape)} is not contiguous: its saver backup cannot be read",
                                             self.rank, "export")
                copy = self.regions.cpu_backup(p.data).to(p.device, copy=True)
                saved.append((p, p.data))
                p.data = copy
            yield
        finally:
            for p, original in reversed(saved):
                p.data = original
            del saved

    # -- the moves: each idempotent, so an undo can ask for a state whatever was reached
    def _release_grads(self) -> None:
        if not self.grads_offloaded:
            self.grads.release(self.regions)
            self.grads_offloaded = True

    def _restore_grads(self) -> None:
        if self.grads_offloaded:
            self.grads.restore(self.regions)
            self.grads_offloaded = False

    def _pause_params(self) -> None:
        if self._params_paused:
            return
        if self.regions.captures:
            self.regions.pause(PARAMS_TAG)
        else:
            # CPU: copy every frozen parameter to its host backup before any is emptied (a failure leaves all)
            backups = {p: p.data.to("cpu", copy=True) for p in self._frozen}
            for p in self._frozen:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._host = backups
        self._params_paused = True

    def _resume_params(self) -> None:
        if not self._params_paused:
            return
        if self.regions.captures:
            self.regions.resume(PARAMS_TAG)
        else:
            restored = {p: self._host[p].to(p.device) for p in self._frozen}  # all made before any is put back
            for p, data in restored.items():
                p.data = data
            self._host = {}
        self._params_paused = False

    def _undo(self, phase: str, step: str, error: BaseException, back: Callable[[], Any], state: str) -> None:
        """``phase`` failed while ``step``: bring the memory ``back`` to one whole state and raise, naming rank,
        phase and step (and ``state``, the state it is in now). An undo that fails too marks the trainer broken."""
        try:
            back()
        except BaseException as undo:
            self.broken = (f"{phase} failed while {step} ({type(error).__name__}: {error}), and undoing it failed "
                           f"too ({type(undo).__name__}: {undo})")
            raise TrainerMemoryError(f"trainer rank {self.rank}: {self.broken}: its memory is in an unknown state; "
                                     "the run stops (restart with --resume)", self.rank, phase) from error
        raise TrainerMemoryError(f"trainer rank {self.rank}: {phase} failed while {step}: {type(error).__name__}: "
                                 f"{error} (the trainer is {state})", self.rank, phase) from error

    def _check_not_broken(self, what: str) -> None:
        if self.broken is not None:
            raise TrainerMemoryError(f"trainer rank {self.rank}: {what} refused: {self.broken}", self.rank, what)


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once (a tied parameter appears under several names)."""
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _movable_frozen(model: nn.Module) -> list[nn.Parameter]:
    """The frozen parameters the CPU analogue moves: every one whose storage no other parameter shares (a shared
    storage stays resident: moving one of its tensors would not free it, and would untie the others)."""
    params = _unique(model.parameters())
    owners: dict[int, int] = {}
    for p in params:
        key = p.untyped_storage()._cdata
        owners[key] = owners.get(key, 0) + 1
    return [p for p in params if not p.requires_grad and owners[p.untyped_storage()._cdata] == 1]
