"""Process groups for the megatron backend: ``torch.distributed`` + megatron's model-parallel groups.

Every group joined or created here carries the run's collective timeout (``distributed_timeout_minutes``, the
recipe's ``--distributed-timeout-minutes``): the world group, and megatron's TP/EP/PP/CP/DP groups with their gloo
twins (``initialize_model_parallel`` passes it to each ``new_group``, but for one: megatron-core 0.16.1 makes its
expert data-parallel gloo group without it, i.e. torch's default of 30 minutes, so it is set here afterwards). A
rank waiting longer than that on a peer that never joins a collective fails with the backend's timeout error
(gloo: "Timed out waiting <ms>ms"; NCCL: the watchdog's "Timeout(ms)=<ms>").

With NCCL every communicator is made at start (the world group bound to this rank's GPU, then one all-reduce of
one element over each of megatron's groups), not at a group's first collective. Made lazily, the first one falls
inside the first training step, where a colocated run's device is fullest: on the H200 under the `make smoke-gpu`
budget the trainer's allocator held all the free memory at that moment, and NCCL's own 4-byte ``cudaMalloc``
failed ("DistBackendError: Failed to CUDA calloc async 4 bytes").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from k3.settings.parallel import ParallelLayout

__all__ = ["DEFAULT_TIMEOUT_MINUTES", "collective_timeout", "init_parallel", "destroy_parallel", "megatron_groups",
           "warm_up_groups"]

DEFAULT_TIMEOUT_MINUTES = 10  # the recipe launcher's --distributed-timeout-minutes default


def collective_timeout(minutes: float) -> timedelta:
    """``minutes`` (> 0, finite; fractions allowed, e.g. seconds-long timeouts in tests) as a ``timedelta``."""
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) or minutes <= 0:
        raise ValueError(f"distributed_timeout_minutes={minutes!r}: expected a number of minutes > 0")
    return timedelta(minutes=minutes)


def init_parallel(layout: ParallelLayout, seed: int | None = 1234, backend: str | None = None,
                  distributed_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """Join the torchrun world (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, or a single process
    when unset) and create megatron's TP/EP/PP/CP/DP groups for ``layout``'s model-parallel sizes.

    ``backend`` defaults to NCCL with CUDA, gloo without. The world size must be a multiple of ``tp * pp``
    and of ``ep * pp`` (experts are not tensor-parallel), and of ``tp * cp * pp``. ``seed`` seeds megatron's model-parallel RNG streams
    (CUDA); None skips it (checkpoint conversion, which draws no random numbers). ``distributed_timeout_minutes``:
    the timeout of every collective of the world group (one joined earlier, e.g. by a previous policy in the same
    process, is set to it too) and of every megatron group created here.
    """
    timeout = collective_timeout(distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a lone process: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        bind: dict = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            bind["device_id"] = torch.device("cuda", local)  # eager communicators, the world's and new groups'
        dist.init_process_group(backend=backend, timeout=timeout, **bind)
    else:
        dist.group.WORLD.set_timeout(timeout)
    world = dist.get_world_size()
    for what, n in (("tensor x pipeline", layout.tp * layout.pp), ("expert x pipeline", layout.ep * layout.pp),
                    ("tensor x context x pipeline", layout.tp * layout.cp * layout.pp)):
        if world % n:
            raise ValueError(f"world size {world} is not a multiple of {what} parallel size {n} "
                             f"(TP={layout.tp}, EP={layout.ep}, PP={layout.pp}, CP={layout.cp})")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=distributed_timeout_minutes,  # megatron's own default is 30
    )
    parallel_state.get_expert_data_parallel_group_gloo().set_timeout(timeout)  # made without it (module docstring)
    if dist.get_backend() == "nccl":
        warm_up_groups(megatron_groups(), torch.device("cuda", torch.cuda.current_device()))
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)


# megatron's groups a training step can use (NCCL ones; their gloo twins need no device memory)
_GROUP_GETTERS: tuple[Callable[[], object], ...] = (
    lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False),
    lambda: parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    lambda: parallel_state.get_context_parallel_group(check_initialized=False),
    lambda: parallel_state.get_model_parallel_group(check_initialized=False),
    lambda: parallel_state.get_data_parallel_group(with_context_parallel=False),
    lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    lambda: parallel_state.get_tensor_and_data_parallel_group(check_initialized=False, with_context_parallel=True),
    lambda: parallel_state.get_tensor_and_context_parallel_group(check_initialized=False),
    lambda: parallel_state.get_expert_model_parallel_group(check_initialized=False),
    lambda: parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    lambda: parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
    lambda: parallel_state.get_expert_data_parallel_group(check_initialized=False),
)


def megatron_groups() -> list[object]:
    """megatron's process groups this rank belongs to (those made for this layout), each once, in a fixed order."""
    groups: list[object] = []
    for getter in _GROUP_GETTERS:
        try:
            group = getter()
        except AssertionError:  # megatron asserts on a group its layout did not make
            continue
        if group is not None and all(group is not g for g in groups):
            groups.append(group)
    return groups


def warm_up_groups(groups: Iterable[object], device: torch.device,
                   all_reduce: Callable[..., object] = dist.all_reduce) -> int:
    """One all-reduce of a one-element zero over the world and over each of ``groups`` (each once), on ``device``,
    then wait for them: every communicator exists afterwards. Returns the number of groups warmed."""
    done: list[object] = []
    for group in [dist.group.WORLD, *groups]:
        if any(group is g for g in done):
            continue
        all_reduce(torch.zeros(1, device=device), group=group)
        done.append(group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(done)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
