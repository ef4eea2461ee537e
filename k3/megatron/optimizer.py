"""Megatron-core's optimizer over the LoRA factors: Adam or SGD, plain or distributed, optionally stepping part of
Adam's state on the host; and the state a resume saves and loads.

- **SGD** (``optimizer="sgd"``, the recipe's debug_minimal: momentum 0, lr 1e-6, weight decay 0): megatron's
  ``OptimizerConfig(optimizer="sgd", sgd_momentum=…)`` (its default momentum is 0.9, so it is always passed).
  Without TransformerEngine or apex (this project) megatron-core steps it with ``torch.optim.SGD``, the recipe's
  choice: at momentum 0 it holds no state at all (TE's FusedSGD would allocate a momentum buffer anyway).
  megatron-core 0.16.1's ``DistributedOptimizer`` asserts on any inner optimizer but Adam "due to checkpointing
  requirements" (its ``state_dict`` / ``load_state_dict`` read Adam's ``step`` and ``exp_avg``), though its step,
  reduce-scatter and all-gather do not depend on the optimizer; so the distributed SGD is built with that one
  check widened to megatron's SGD class for the call (:func:`_distributed_optimizer_admits_sgd`), and its state is
  saved and loaded here, without megatron's Adam-only readers (below).
- **Distributed** (``distributed``, the recipe's ``--use-distributed-optimizer``): megatron's
  ``DistributedOptimizer``. DDP reduce-scatters the gradient buffer instead of all-reducing it; each data-parallel
  rank holds the Adam state (fp32 main weights, ``exp_avg``, ``exp_avg_sq``) of its 1/DP slice of the buffer only,
  steps that slice, and the updated weights are all-gathered. The plain optimizer holds the whole state on every
  data-parallel rank.
- **CPU offload** (``cpu_offload`` / ``offload_fraction``, the recipe's ``--optimizer-cpu-offload
  --optimizer-offload-fraction 0.8 --overlap-cpu-optimizer-d2h-h2d``): megatron's ``HybridDeviceOptimizer``. Of
  this rank's CUDA optimizer state, the first ``offload_fraction`` (by element count, whole parameters in order)
  is copied to pinned host memory and stepped there by torch's Adam, its copies overlapped with the device on CUDA
  streams; the rest steps on the GPU. What megatron-core 0.16.1 needs for it, so what
  :func:`check_optimizer_options` refuses otherwise, in one line: the distributed optimizer (the path Megatron-LM
  validates), CUDA (it moves CUDA parameters and runs on CUDA streams; on CPU it cannot step), and a fraction in
  [0, 1]; and Adam (the recipe offloads in normal mode only; k3 saves and loads no hybrid SGD state). A fraction
  above 0 without the offload is refused too: it would be printed and never applied.
  The recipe also passes ``--use-precision-aware-optimizer``, with which the hybrid optimizer holds the fp32 main
  weights itself; megatron-core's ``OptimizerConfig`` needs TransformerEngine for that (it fails without it), and
  this project runs without TE. So here the GPU keeps the fp32 main weights of its slice and the host holds the
  offloaded part's copy and Adam moments.

:func:`optimizer_state_dict` / :func:`load_optimizer_state_dict` are this rank's optimizer state for a checkpoint
and back. The plain optimizer's is megatron's ``state_dict()``. The distributed optimizer's ``state_dict()`` holds
no parameter state (megatron keeps that in a separate file); its own reader, ``load_state_dict``, takes the
parameter state along under ``param_state``, in one of megatron's formats. The one used here is
``dp_reshardable``: per bucket of the gradient buffer, per parameter range this rank owns, its main weights and Adam
moments (``get_parameter_state_dp_reshardable``), so every rank saves and reads its own slice with no collective
(the load then all-gathers the restored weights, as a step does). The distributed SGD's state is the same
``dp_reshardable`` parameter state (fp32 main weights, and the momentum buffers where SGD has made them: none at
momentum 0), tagged ``optimizer_kind: "sgd"``, with none of megatron's Adam-only ``state_dict()``. With the CPU
offload, the state leaves out the hybrid optimizer's sub-optimizer classes (code, which a weights-only load refuses),
and is loaded in place by k3 (:func:`_load_hybrid_adam`): megatron-core 0.16.1's reader fails on fp32 main weights.
After an adapter load, :func:`reload_main_params` refreshes the main weights (and the offloaded ones' host copies,
which megatron's ``reload_model_params`` leaves stale).

Either load keeps the run's hyperparameters (lr, weight decay, betas, momentum:
``k3.settings.train.keep_hyperparameters``), which megatron's and torch's loaders would replace with the saved
run's; and a state of the other optimizer (Adam into SGD, or back) is refused in one line before anything is
loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import megatron.core.optimizer as megatron_optimizers
import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import distrib_optimizer as distrib_module
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

from k3.settings.train import (keep_hyperparameters, optimizer_kind_problem, optimizer_options_problem,
                               restore_hyperparameters)

__all__ = ["OptimizerOptionError", "build_megatron_optimizer", "check_optimizer_options", "fresh_adam_state",
           "is_distributed", "load_optimizer_state_dict", "optimizer_kind", "optimizer_state_dict",
           "reload_main_params", "require_offload_device"]

DP_RESHARDABLE = "dp_reshardable"  # megatron's name of the per-rank, bucket-ordered parameter-state format
KIND_KEY = "optimizer_kind"  # the tag of a distributed SGD part's state (megatron's Adam state has none)


class OptimizerOptionError(ValueError):
    """An optimizer setting megatron-core cannot honour here; the message names the setting and what to change."""


def check_optimizer_options(distributed: bool, cpu_offload: bool, offload_fraction: float, optimizer: str = "adam",
                            sgd_momentum: float = 0.0) -> None:
    """Refuse, in one line, a combination megatron-core 0.16.1 cannot run (module docstring; the rule is
    ``k3.settings.train.optimizer_options_problem``, which the run's settings check at parse time); not the device."""
    problem = optimizer_options_problem(distributed, cpu_offload, offload_fraction, optimizer, sgd_momentum)
    if problem is not None:
        raise OptimizerOptionError(problem)


def require_offload_device() -> None:
    """Raise unless CUDA is usable: megatron's hybrid optimizer offloads CUDA state to pinned host memory over
    CUDA streams. Looked up at call time (``build_megatron_optimizer``), so a CPU test of the wiring can stand in."""
    if not torch.cuda.is_available():
        raise OptimizerOptionError("optimizer_cpu_offload needs CUDA (megatron-core offloads CUDA optimizer state "
                                   "to pinned host memory on CUDA streams), and this process has no CUDA device: "
                                   "turn the offload off")


@contextlib.contextmanager
def _distributed_optimizer_admits_sgd() -> Iterator[None]:
    """While open, megatron-core 0.16.1's ``DistributedOptimizer`` accepts megatron's SGD class as its inner
    optimizer: its constructor's only check is ``isinstance(optimizer, (Adam, AdamW, HybridDeviceOptimizer))`` on
    the module's name ``Adam``, widened here to the tuple ``(Adam, SGD)`` (``isinstance`` takes nested tuples).
    Nothing else in that module reads the name; the checkpoint code it guards is not used for SGD (module
    docstring)."""
    adam = distrib_module.Adam
    distrib_module.Adam = (adam, megatron_optimizers.SGD)
    try:
        yield
    finally:
        distrib_module.Adam = adam


def build_megatron_optimizer(model: list, *, lr: float, weight_decay: float, clip_grad: float,
                             betas: tuple[float, float], adam_eps: float, bf16: bool, params_dtype: torch.dtype,
                             distributed: bool = False, cpu_offload: bool = False, offload_fraction: float = 0.0,
                             optimizer: str = "adam", sgd_momentum: float = 0.0):
    """Megatron's ``optimizer`` over the trainable parameters of the DDP-wrapped ``model`` chunks: Adam (decoupled
    weight decay, i.e. AdamW; ``betas``, ``adam_eps``) or SGD (``sgd_momentum``; weight decay added to the
    gradient); megatron exempts 1-D parameters and biases from decay. Plain or distributed, with Adam's CPU offload
    (module docstring). ``model``'s DDP must have been built with ``use_distributed_optimizer=distributed``.
    Raises :class:`OptimizerOptionError` first (one line) for a combination or a device that cannot run it."""
    check_optimizer_options(distributed, cpu_offload, offload_fraction, optimizer, sgd_momentum)
    for chunk in model:
        if chunk.ddp_config.use_distributed_optimizer != distributed:
            raise OptimizerOptionError(f"the model's DDP has use_distributed_optimizer="
                                       f"{chunk.ddp_config.use_distributed_optimizer}, the optimizer {distributed}: "
                                       "build both with the same setting")
    if cpu_offload:
        require_offload_device()
    config = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                             adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=adam_eps,
                             sgd_momentum=float(sgd_momentum), bf16=bf16,
                             params_dtype=params_dtype, use_distributed_optimizer=distributed,
                             optimizer_cpu_offload=cpu_offload,
                             optimizer_offload_fraction=float(offload_fraction) if cpu_offload else 0.0,
                             # the recipe's overlap of the host step's copies (module docstring: no precision-aware path)
                             overlap_cpu_optimizer_d2h_h2d=cpu_offload)
    if optimizer == "sgd" and distributed:
        with _distributed_optimizer_admits_sgd():
            return get_megatron_optimizer(config, model)
    return get_megatron_optimizer(config, model)


def _parts(optimizer) -> list:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (megatron's, chained or not) is the distributed optimizer."""
    return any(isinstance(part, DistributedOptimizer) for part in _parts(optimizer))


def optimizer_kind(optimizer) -> str:
    """``"adam"`` or ``"sgd"``: the optimizer ``optimizer`` (megatron's, chained or not) was built as."""
    kinds = {part.config.optimizer for part in _parts(optimizer)}
    if len(kinds) != 1:
        raise ValueError(f"the chained optimizers were built as {sorted(kinds)}: expected one optimizer")
    return kinds.pop()


@torch.no_grad()
def reload_main_params(optimizer) -> None:
    """Copy the model's parameters into ``optimizer``'s main weights, after something other than a step wrote
    them (an adapter load): megatron's ``reload_model_params``, except for the CPU offload's hybrid optimizer,
    where megatron-core 0.16.1 refreshes only the fp32 copies it makes of low-precision parameters (none: the
    distributed optimizer hands it fp32 main weights) and so leaves the main weights and their host copies stale,
    and the next step would write the old adapters back. There each part's main weights (this rank's slice of
    each parameter) and the host copy of every offloaded one are copied here."""
    for part in _parts(optimizer):
        hybrid = getattr(part, "optimizer", None)
        if not isinstance(hybrid, HybridDeviceOptimizer):
            part.reload_model_params()
            continue
        for model_param, (group_index, group_order) in part.model_param_group_index_map.items():
            owned = part._get_model_param_range_map(model_param)["param"]
            main = hybrid.param_groups[group_index]["params"][group_order]
            main.copy_(model_param.detach().view(-1)[owned.start:owned.end])
            host = hybrid.gpu_params_map_cpu_copy.get(main)
            if host is not None:
                host.copy_(main)


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor replaced by a detached host copy (containers rebuilt, other values kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    return value


def _param_state(part: DistributedOptimizer) -> dict[str, Any]:
    """Host copies of this rank's ``dp_reshardable`` parameter state (main weights and the optimizer's state)."""
    param_state = _host_copy(part.get_parameter_state_dp_reshardable())
    for key, per_dtype in param_state.items():
        if isinstance(key, int):  # a gradient buffer: {dtype: [bucket: [owned parameter range: tensors]]}
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        # The reader skips padding entries; this rank's own ranges hold none.
                        entry["padding"] = False
    return param_state


def _distributed_part_state(part: DistributedOptimizer) -> dict[str, Any]:
    if part.config.optimizer == "sgd":
        # megatron's state_dict() reads Adam's per-parameter ``step``; SGD's state is its main weights and momentum
        # buffers (none at momentum 0, and the main weights matter even then: BF16 parameters round them).
        return {KIND_KEY: "sgd", "param_state": _param_state(part), "param_state_sharding_type": DP_RESHARDABLE}
    if len(part.optimizer.state) == 0:
        # Never stepped: no Adam state exists yet (and megatron's state_dict() needs one to read the step count).
        return {"never_stepped": True}
    state = part.state_dict()
    # The hybrid optimizer keeps its sub-optimizers' classes (torch's AdamW) in every param group: code, not state,
    # which torch.load(weights_only=True) refuses. The reader below takes them from the optimizer it loads into.
    state["optimizer"]["param_groups"] = [{k: v for k, v in group.items() if not isinstance(v, type)}
                                          for group in state["optimizer"]["param_groups"]]
    state["param_state"] = _param_state(part)
    state["param_state_sharding_type"] = DP_RESHARDABLE
    return state


def _load_hybrid_adam(part: DistributedOptimizer, part_state: dict[str, Any]) -> None:
    """Restore a distributed Adam part whose inner optimizer is megatron's ``HybridDeviceOptimizer`` (the CPU
    offload), in place. megatron-core 0.16.1's own reader cannot: the hybrid optimizer's post-load hook looks
    every parameter up among the fp32 copies it makes of low-precision parameters, and the distributed optimizer
    hands it fp32 main weights, so it has none (KeyError); and the hook rebuilds the host copies from the weights
    before the parameter state is loaded. Here the state entries are made first where the optimizer has none yet
    (a fresh optimizer: what torch's Adam makes at its first step, zeros at step 0), then megatron's
    ``dp_reshardable`` reader copies every saved tensor into them: the main weights, ``step``, the moments, and
    ``master_param`` (the host copy an offloaded parameter steps on). The sub-optimizers hold the same state
    dicts, so they step on from the loaded values."""
    hybrid = part.optimizer
    if len(hybrid.state) == 0:
        for sub in hybrid.sub_optimizers:
            for group in sub.param_groups:
                for param in group["params"]:
                    sub.state[param].update(fresh_adam_state(param, group))
        hybrid._sync_sub_optimizers_state_to_hdo()
    part.load_parameter_state_from_dp_reshardable(part_state["param_state"])


def fresh_adam_state(param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state torch's Adam makes for ``param`` at its first step, at step 0: zero moments beside ``param``, and
    a float32 ``step`` on ``param``'s device for a fused or capturable group (the fused CUDA kernel refuses a host
    ``step``), on the host otherwise."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    return {"step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
            "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}


def optimizer_state_dict(optimizer) -> dict[str, Any] | list[dict[str, Any]]:
    """This rank's optimizer state (module docstring): megatron's ``state_dict()`` for the plain optimizer; for the
    distributed one, per optimizer it chains (dense, then expert-parallel parameters), its ``state_dict()`` plus
    host copies of this rank's parameter state (SGD: the parameter state alone, tagged). A list when megatron
    chains several optimizers, as its own ``state_dict()``."""
    if not is_distributed(optimizer):
        return optimizer.state_dict()
    parts = [_distributed_part_state(part) for part in _parts(optimizer)]
    return parts[0] if len(parts) == 1 else parts


def _load_distributed_sgd(part: DistributedOptimizer, part_state: dict[str, Any]) -> None:
    """Restore ``_distributed_part_state``'s SGD state: the main weights, and exactly the momentum buffers it holds
    (megatron's reader copies into the state entries the optimizer has, so they are made to match first)."""
    state, inner = part_state["param_state"], part.optimizer
    for gbuf_idx, gbuf_range_maps in enumerate(part.gbuf_ranges):
        for dtype, range_maps in gbuf_range_maps.items():
            for bucket_idx, range_map in enumerate(range_maps):
                saved = [e for e in state[gbuf_idx][dtype][bucket_idx] if not e["padding"]]
                if len(saved) != len(range_map["param_map"]):
                    raise ValueError(f"the optimizer state holds {len(saved)} parameter ranges in bucket "
                                     f"{bucket_idx}, this rank owns {len(range_map['param_map'])}: it was saved for "
                                     "another model or layout")
                for entry, model_param in zip(saved, range_map["param_map"]):
                    group_index, group_order = part.model_param_group_index_map[model_param]
                    main_param = inner.param_groups[group_index]["params"][group_order]
                    inner.state.pop(main_param, None)
                    if "momentum_buffer" in entry:
                        inner.state[main_param]["momentum_buffer"] = torch.empty_like(main_param)
    part.load_parameter_state_from_dp_reshardable(state)


@torch.no_grad()  # the fp32 main weights are views of the parameters (leaves that require grad)
def load_optimizer_state_dict(optimizer, state: dict[str, Any] | list[dict[str, Any]], model: list,
                              saved_kind: str = "adam") -> None:
    """Restore :func:`optimizer_state_dict` output, saved by a ``saved_kind`` optimizer (``"adam"`` / ``"sgd"``),
    into ``optimizer`` (built for the same layout), keeping the run's hyperparameters (module docstring); a state
    of the other kind raises ``ValueError`` (one line) before anything is loaded. For the distributed optimizer,
    the restored main weights are then written into the model's parameters and all-gathered over the data-parallel
    ranks (what its step does after an update), so every replica holds them at once rather than only this rank's
    slice until the next step. Collective over the data-parallel group(s)."""
    kind = optimizer_kind(optimizer)
    problem = optimizer_kind_problem(saved_kind, kind)
    if problem is not None:
        raise ValueError(problem)
    kept = keep_hyperparameters(optimizer.param_groups)
    if not is_distributed(optimizer):
        optimizer.load_state_dict(state)
        restore_hyperparameters(optimizer.param_groups, kept)
        return
    parts = _parts(optimizer)
    states = state if isinstance(state, list) else [state]
    if len(states) != len(parts):
        raise ValueError(f"the optimizer state holds {len(states)} optimizer(s), this optimizer chains {len(parts)}: "
                         "it was saved for another model or layout")
    for part_state in states:
        problem = optimizer_kind_problem(part_state.get(KIND_KEY, "adam"), kind)
        if problem is not None:
            raise ValueError(problem)
    for part, part_state in zip(parts, states):
        if part_state.get("never_stepped"):
            continue  # a fresh optimizer is what was saved
        if part_state.get("param_state_sharding_type") != DP_RESHARDABLE:
            raise ValueError("the optimizer state holds no distributed-optimizer parameter state (saved by the plain "
                             "optimizer?): resume with the optimizer that saved it")
        if kind == "sgd":
            _load_distributed_sgd(part, part_state)
        elif isinstance(part.optimizer, HybridDeviceOptimizer):
            _load_hybrid_adam(part, part_state)
        else:
            part.load_state_dict(part_state)
            # Without TE/apex, megatron gives every parameter's state one shared ``step`` tensor; torch's Adam then
            # adds 1 to it once per parameter at the next step (the bias correction of step 3 + N instead of 3):
            # unshare.
            for param_state in part.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()
        # megatron's step does these two after an update (step_with_ready_grads)
        part._copy_main_params_to_model_params()
    restore_hyperparameters(optimizer.param_groups, kept)
    for chunk in model:
        chunk.start_param_sync(force_sync=True)
