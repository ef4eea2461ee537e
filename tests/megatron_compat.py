"""Test-only: run megatron-core 0.16.1 on a CPU-only torch over gloo.

megatron-core assumes CUDA in places that do not change its parallel math: RNG state through ``torch.cuda``,
``device="cuda"`` tensor factories, ``.cuda()`` moves, CUDA streams around the all-to-all dispatcher, a
``torch.cuda.FloatTensor`` type check in the optimizer and gradient clipping (reference/dependencies.md §1), and the
CPU offload's ``HybridDeviceOptimizer``, which picks the parameters to offload by ``is_cuda`` and pins its host
copies.
``install()`` patches exactly those, so the K3 megatron modules run their real TP/EP/SP code paths on gloo.

Import this only in a subprocess that runs megatron code and nothing else (a torchrun worker): it patches
``torch.cuda``, ``Tensor.cuda`` and ``Tensor.type`` process-wide and keeps a TorchFunctionMode active. It is
never imported by ``k3/``; on a CUDA machine the GPU tests run megatron without it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["RESULT_FILE", "install", "installed", "run_workers", "save_result", "worker_result"]

MEGATRON_VERSION = "0.16.1"
_STATE = {"installed": False}
CPU = torch.device("cpu")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` / ``device=<int>`` arguments of tensor factories and ``.to()`` to CPU."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA device
        if func in (torch.Tensor.to,) and args:
            args = tuple(CPU if _is_cuda_device(a) and not isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class _FakeStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return _FakeEvent()

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: that one must not recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    cuda.synchronize = lambda device=None: None
    cuda.current_device = lambda: CPU
    cuda.device_count = lambda: 1
    cuda.Stream = _FakeStream
    cuda.Event = _FakeEvent
    cuda.current_stream = lambda device=None: _FakeStream()
    cuda.default_stream = lambda device=None: _FakeStream()
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.record_stream = lambda self, stream: None
    # The optimizer and clip_grad assert the legacy CUDA type names; report them for floating CPU tensors.
    original_type = torch.Tensor.type

    def cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            # Under the TorchFunctionMode the original reaches this patch again: name a CUDA type once.
            cuda_name = name.startswith("torch.") and not name.startswith("torch.cuda.")
            return name.replace("torch.", "torch.cuda.", 1) if cuda_name else name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_named_type


def _patch_megatron() -> None:
    from megatron.core import package_info
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if package_info.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"tests/megatron_compat.py is written for megatron-core {MEGATRON_VERSION}, "
                           f"found {package_info.__version__}")
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        # On CUDA the all-to-all split sizes arrive as numpy after the D2H copy; gloo needs the same lists.
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu
    _patch_clip_grad()
    _patch_hybrid_optimizer()


def _patch_hybrid_optimizer() -> None:
    """The CPU offload's ``HybridDeviceOptimizer`` splits its parameters into device ones (``is_cuda``) and host
    copies (``.cpu().pin_memory()``) of the first ``offload_fraction`` of them. While it splits, every tensor
    reports ``is_cuda`` but its host copies, which ``pin_memory`` marks: so on CPU it offloads the same parameters
    it would on a GPU, and steps them with its host optimizer on separate copies that it copies back."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    cls = hybrid_optimizer.HybridDeviceOptimizer
    split = cls._get_sub_optimizer_param_groups

    def split_as_on_a_gpu(self, offload_fraction):
        saved = torch.Tensor.is_cuda, torch.Tensor.pin_memory

        def pin_memory(tensor, *args, **kwargs):
            tensor._compat_host_copy = True
            return tensor

        torch.Tensor.is_cuda = property(lambda t: not getattr(t, "_compat_host_copy", False))
        torch.Tensor.pin_memory = pin_memory
        try:
            return split(self, offload_fraction)
        finally:
            torch.Tensor.is_cuda, torch.Tensor.pin_memory = saved

    cls._get_sub_optimizer_param_groups = split_as_on_a_gpu


def _patch_clip_grad() -> None:
    """``clip_grad_by_total_norm_fp32`` asserts CUDA float grads and uses apex's multi-tensor scale."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                grads.append(g.detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def install() -> None:
    """Apply every patch once (idempotent). Call before building megatron models."""
    if _STATE["installed"]:
        return
    _patch_torch_cuda()
    _patch_megatron()
    mode = _CudaToCpu()
    mode.__enter__()  # stays active for the life of the worker process
    _STATE["mode"] = mode
    _STATE["installed"] = True


def installed() -> bool:
    return _STATE["installed"]


# ---------------------------------------------------------------------------------------------- launching workers
RESULT_FILE = "result.pt"  # what a worker script saves into its folder for the test to read


def save_result(result: dict, folder) -> None:
    """The worker's side: ``result`` into ``folder/result.pt``, by global rank 0 only (a torchrun's other ranks
    report through it)."""
    import os
    from pathlib import Path

    if os.environ.get("RANK", "0") == "0":
        torch.save(result, Path(folder) / RESULT_FILE)


def worker_result(args: list[str], folder, nproc: int = 1, timeout: float = 240.0) -> dict:
    """The test's side: run the worker ``args`` (:func:`run_workers`), which writes into ``folder`` (one of its
    arguments), and return what it saved with :func:`save_result`."""
    from pathlib import Path

    run_workers(args, nproc=nproc, timeout=timeout)
    return torch.load(Path(folder) / RESULT_FILE, weights_only=False)


def _text(output: str | bytes | None) -> str:
    """What a killed subprocess printed: ``TimeoutExpired`` holds bytes (or None) even for a text-mode run."""
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_workers(args: list[str], nproc: int = 1, timeout: float = 240.0, env: dict | None = None):
    """Run ``python <args>`` (``nproc == 1``) or ``torchrun --nproc-per-node nproc <args>`` from the repo root
    with one thread per process, a free port on 127.0.0.1 and a timeout; returns the CompletedProcess and
    raises AssertionError with the output tail when it fails. ``args[0]`` is a script path or ``-m module``.

    On a GPU the workers check numbers, not speed: ``K3_FLA_PINNED_CONFIGS=cover`` (unless set) serves an fla key
    that is not recorded from the config of a recorded key that covers it, where a fresh host would autotune each
    new key for ~16 s."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # The port is free when asked for, but it is in the ephemeral range: any process's outgoing connection (the
    # other xdist worker's gloo or Ray, say) may take it before the workers bind it. Then run again on another.
    for attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        full_env = dict(os.environ)
        full_env.setdefault("K3_FLA_PINNED_CONFIGS", "cover")
        full_env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), full_env.get("PYTHONPATH", "")]),
                        PYTHONWARNINGS="ignore")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            full_env.pop(key, None)
        full_env.update(env or {})
        if nproc == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                   "127.0.0.1", "--master-port", str(port), *args]
        try:
            proc = subprocess.run(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            # run() kills the workers and keeps what they printed: without it a worker that ran out of time (a GPU
            # one autotuning fla, say) would leave nothing to say where its time went
            raise AssertionError(f"{' '.join(cmd)} ran past {timeout:.0f} s and was killed:\n"
                                 f"{(_text(e.stdout) + _text(e.stderr))[-6000:]}") from None
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or "EADDRINUSE" not in out or attempt == 2:
            break
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}")
    return proc
