"""Process groups for the megatron backend: ``torch.distributed`` + megatron's model-parallel groups.

Every group joined or created here carries the run's collective timeout (``distributed_timeout_minutes``, the
recipe's ``--distributed-timeout-minutes``): the world group, and megatron's TP/EP/PP/CP/DP groups with their gloo
twins (``initialize_model_parallel`` passes it to each ``new_group``, but for one: megatron-core 0.16.1 makes its
expert data-parallel gloo group without it, i.e. torch's default of 30 minutes, so it is set here afterwards). A
rank waiting longer than that on a peer that never joins a collective fails with the backend's timeout error
(gloo: "Timed out waiting <ms>ms"; NCCL: the watchdog's "Timeout(ms)=<ms>").

With NCCL every communicator is made at start, not at a group's first collective: the world group is bound to this
rank's GPU (``device_id``), and torch connects it and every group made after it as each is created (``new_group``
inherits the bound device; megatron's groups included). Made lazily, the first one falls inside the first training
step, where a colocated run's device is fullest: on the H200 under the `make smoke-gpu` budget that step failed in
one of NCCL's own allocations ("DistBackendError: Failed to CUDA calloc async 4 bytes"), most likely a communicator
being made. Made at start, they take their memory while the model is built instead (at a budget of 0.2 of the
device that was the ~2.3 GiB the build had to spare; the trainer prints what the device holds after both).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from k3.settings.parallel import ParallelLayout

__all__ = ["DEFAULT_TIMEOUT_MINUTES", "collective_timeout", "init_parallel", "destroy_parallel"]

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
            bind["device_id"] = torch.device("cuda", local)  # eager communicators (module docstring)
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
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)


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
