"""The parallel layout of a run: one type for the launcher, the trainers and the megatron backend.

:class:`ParallelLayout` holds how the training ranks split into TP × CP × PP × DP (and EP), how the decoder layers
split over pipeline stages, and how the colocated rollout engines split the same GPUs. The launcher derives the
whole layout from its flags (``k3.launch.layout.derive_layout``, the recipe's rules); megatron code and tests that
need only the model-parallel sizes build one with :meth:`ParallelLayout.model_parallel` (data parallelism is then
whatever the process group leaves, and the rollout fields are unset).

Pure data: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelLayout"]

# The short name each validated field is known by (its property, and the name its error message uses).
_SHORT_NAMES = {
    "tensor_model_parallel_size": "tp",
    "expert_model_parallel_size": "ep",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_tensor_parallel_size": "etp",
    "data_parallel_size": "dp",
    "world_size": "world_size",
    "num_layers": "num_layers",
    "rollout_tp_size": "rollout_tp_size",
    "rollout_ep_size": "rollout_ep_size",
    "num_rollout_engines": "num_rollout_engines",
}
_REQUIRED = ("tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size",
             "context_parallel_size", "expert_tensor_parallel_size")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelLayout:
    """The training and rollout parallelism of a run. Field names are Megatron's argument names (they are keys of
    the resolved-config dump).

    ``world_size`` counts training ranks (one per GPU; 1 for a CPU run); ``data_parallel_size`` is what remains
    of it after TP × CP × PP. ``pipeline_layers[s]`` is the number of decoder layers on pipeline stage ``s``;
    ``decoder_first/last_pipeline_num_layers`` are set only when the stages are uneven (megatron's
    ``--decoder-first/last-pipeline-num-layers``). ``rollout_tp_size`` / ``rollout_ep_size`` size each rollout
    engine, ``num_rollout_engines`` counts them. A model-parallel-only layout (:meth:`model_parallel`) leaves
    ``world_size``, ``data_parallel_size``, ``num_layers``, ``pipeline_layers`` and the rollout fields unset.

    Raises ``ValueError`` naming the field (by its short name: ``ParallelLayout.cp=0: ...``) when a size is not an
    integer >= 1, or an uneven stage size is given without pipeline parallelism.
    """

    world_size: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    data_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    num_layers: int | None = None
    pipeline_layers: tuple[int, ...] = ()
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    rollout_tp_size: int | None = None
    rollout_ep_size: int | None = None
    num_rollout_engines: int | None = None

    def __post_init__(self) -> None:
        for name, short in _SHORT_NAMES.items():
            value = getattr(self, name)
            if (name in _REQUIRED or value is not None) and not _is_count(value):
                raise ValueError(f"ParallelLayout.{short}={value!r}: expected an integer >= 1")
        for name, short in (("decoder_first_pipeline_num_layers", "first_stage_layers"),
                            ("decoder_last_pipeline_num_layers", "last_stage_layers")):
            value = getattr(self, name)
            if value is not None and (not _is_count(value) or self.pipeline_model_parallel_size == 1):
                raise ValueError(f"ParallelLayout.{short}={value!r}: expected None, or an integer >= 1 with pp > 1")

    @classmethod
    def model_parallel(cls, tp: int = 1, ep: int = 1, pp: int = 1, cp: int = 1,
                       first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> ParallelLayout:
        """A layout of model-parallel sizes only: TP ``tp``, EP ``ep``, PP ``pp``, CP ``cp`` and megatron's uneven
        pipeline split (``first_stage_layers`` / ``last_stage_layers``, None: even). Sequence parallelism is on
        whenever TP > 1, as the launcher sets it."""
        return cls(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                   context_parallel_size=cp, sequence_parallel=isinstance(tp, int) and tp > 1,
                   decoder_first_pipeline_num_layers=first_stage_layers,
                   decoder_last_pipeline_num_layers=last_stage_layers)

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def first_stage_layers(self) -> int | None:
        """Layers of the first pipeline stage under an uneven split; None: even."""
        return self.decoder_first_pipeline_num_layers

    @property
    def last_stage_layers(self) -> int | None:
        """Layers of the last pipeline stage under an uneven split; None: even."""
        return self.decoder_last_pipeline_num_layers
