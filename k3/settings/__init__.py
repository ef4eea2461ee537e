"""Run settings at the bottom of the house: frozen, typed, pure data built once by the launcher.

Each part takes only its own settings object. This package imports nothing of ``k3`` but ``k3.config``, so every
part may import it. One concept per module:

- ``lora``: ``LoRAConfig`` and the LoRA target table;
- ``parallel``: ``ParallelLayout``, the one parallel layout (launcher, trainers, megatron);
- ``rollout``: ``RolloutSettings`` (sampling, eval, the engines' sizes and sources);
- ``colocate``: ``ColocateSettings`` (the memory hand-off between trainer and engines);
- ``decode``: ``DecodeSettings`` (how the embedded engine decodes: cache, CUDA graphs, kernels);
- ``train``: ``TrainingSettings``, ``OptimizerSettings``, ``GRPOSettings`` (the trainer's);
- ``data``: ``DataSettings`` (training and eval files);
- ``run``: ``RunSettings``, the loop's own values holding every section above;
- ``worker``: ``WorkerSpec``, what the trainer's and the engine's workers build their model from.
"""
