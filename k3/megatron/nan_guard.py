"""``check_for_nan_in_loss_and_grad`` on the megatron backend: a NaN or Inf in a loss or in a rank's gradients stops
the step before anything is applied, with an error that names the rank(s) and the optimizer step.

Where it looks, per training step (``MegatronLoRATrainer.step`` with a :class:`NanGuard`):

- the loss share of every micro-batch, on the rank that computes it (the last pipeline stage), as the schedule
  hands it back (no host sync per micro-batch: the flags stay on the device);
- every trainable parameter's gradient on every rank *before* any reduction (K3's TP/EP sums and the data-parallel
  all-reduce or reduce-scatter, which would copy one rank's NaN to all): :meth:`NanGuard.note_grads` runs as the
  first thing of the trainer's ``finalize_model_grads_func``, so the rank named is one whose own backward made the
  value (or received it through a collective inside the backward, e.g. sequence parallelism's: then those ranks
  are named too).

Then every rank adds its flags into one small tensor over the world group, so every rank raises the same
:class:`NonFiniteError` or none does (no rank is left waiting in a collective on one that raised). Only on that
error path are the per-rank details (micro-batch index, the first parameter names) exchanged.

Why not megatron-core's own check (``DistributedDataParallelConfig.check_for_nan_in_grad``, the rerun state
machine): it raises on the failing rank alone, leaving its peers blocked in the data-parallel collective until the
timeout, and it names the rerun state machine's iteration, which this trainer does not drive. The check here runs at
the same place (local gradients, before the collective) and adds the loss.

With the setting off no guard exists: the finalize hook is megatron's (via ``k3.megatron.grads``) and no flag is
computed. The trainer's own guard stays on either way: a non-finite global gradient norm never updates the
adapters (``MegatronLoRATrainer.step``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["NanGuard", "NonFiniteError"]

_SHOWN = 3  # parameter names per rank in the message


class NonFiniteError(FloatingPointError):
    """A NaN or Inf in the loss or the gradients of a training step; ``ranks``: the global ranks where it appeared
    first, ``step``: the optimizer step (0-based count of steps applied before it)."""

    def __init__(self, message: str, ranks: tuple[int, ...], step: int | None) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.step = step


class NanGuard:
    """The check of one training step (module docstring). ``step``: the optimizer step index named in the error;
    ``names``: parameter → name, to name offending gradients."""

    def __init__(self, step: int | None, names: dict[torch.nn.Parameter, str]) -> None:
        self.step = step
        self._names = names
        self._loss: list[torch.Tensor] = []  # per micro-batch: [isnan, isinf] of its loss share, on its device
        self._grads: list[tuple[str, torch.Tensor]] = []  # (name, gradient norm) of this rank's local gradients

    def note_loss(self, share: torch.Tensor) -> None:
        """A micro-batch's loss share (scalar), in schedule order."""
        s = share.detach().float()
        self._loss.append(torch.stack([torch.isnan(s), torch.isinf(s)]).reshape(2))

    def note_grads(self, model: Sequence[torch.nn.Module]) -> None:
        """This rank's trainable gradients as they are now (call before any reduction). One fused norm pass."""
        named, grads = [], []
        for chunk in model:
            for param in chunk.parameters():
                if not param.requires_grad:
                    continue
                g = getattr(param, "main_grad", None)
                g = param.grad if g is None else g
                if g is not None:
                    named.append(self._names.get(param, "<unnamed parameter>"))
                    grads.append(g.detach())
        if grads:
            # A norm is NaN when an element is, Inf when one is (or the squares overflow float32).
            norms = torch._foreach_norm([g.float() for g in grads])
            self._grads = list(zip(named, norms))

    def _local(self, device: torch.device) -> torch.Tensor:
        """``[loss NaN, loss Inf, grad NaN, grad Inf]`` of this rank (int64 counts on ``device``)."""
        row = torch.zeros(4, dtype=torch.int64, device=device)
        if self._loss:
            row[:2] = torch.stack(self._loss).to(device).sum(0)
        if self._grads:
            norms = torch.stack([n for _, n in self._grads]).to(device)
            row[2], row[3] = torch.isnan(norms).sum(), torch.isinf(norms).sum()
        return row

    def _detail(self) -> str:
        """This rank's findings in words (the error path only: reads the flags to the host)."""
        parts = []
        if self._loss:
            flags = torch.stack(self._loss).cpu()
            for col, what in ((0, "NaN"), (1, "Inf")):
                bad = torch.nonzero(flags[:, col]).flatten().tolist()
                if bad:
                    parts.append(f"{what} in the loss of micro-batch{'es' if len(bad) > 1 else ''} "
                                 f"{', '.join(map(str, bad))}")
        for check, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            bad = [name for name, norm in self._grads if bool(check(norm))]
            if bad:
                more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
                parts.append(f"{what} in the gradients of {', '.join(bad[:_SHOWN])}{more}")
        return "; ".join(parts)

    def raise_if_any(self, device: torch.device) -> None:
        """Collective over the world group: raise :class:`NonFiniteError` on every rank when any rank saw a NaN or
        Inf this step; return on every rank otherwise."""
        local = self._local(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            world, rank = dist.get_world_size(), dist.get_rank()
            table = torch.zeros(world, 4, dtype=torch.int64, device=device)
            table[rank] = local
            dist.all_reduce(table)
            bad = [r for r, count in enumerate(table.sum(1).tolist()) if count > 0]  # one read to the host
            if not bad:
                return
            details: list[str | None] = [None] * world
            dist.all_gather_object(details, self._detail() if rank in bad else "")
        else:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if int(local.sum()) == 0:
                return
            bad, details = [rank], {rank: self._detail()}
        where = "; ".join(f"rank {r}: {details[r]}" for r in bad)
        at = "" if self.step is None else f" at optimizer step {self.step}"
        raise NonFiniteError(f"NaN/Inf{at}, the step was not applied (check_for_nan_in_loss_and_grad; gradients as "
                             f"each rank computed them, before any reduction): {where}", ranks=tuple(bad),
                             step=self.step)
