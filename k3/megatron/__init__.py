"""Megatron-core backend of K3 (megatron-core 0.16.1, no TransformerEngine needed).

- ``config``: ``k3_transformer_config`` (TransformerConfig of K3 for a TP/EP/PP layout);
- ``spec`` / ``model``: ``get_k3_spec`` (the layers of a pipeline stage) and ``k3_model_provider`` (GPTModel);
- ``kda`` / ``mla`` / ``mlp`` / ``moe`` / ``layer``: K3's modules on megatron's parallel linears, router and
  token dispatcher, with the reference model's math (``k3.model``);
- ``lora`` / ``grads`` / ``training``: adapters under TP/EP, their gradient reductions, a LoRA training step;
- ``optimizer`` / ``nan_guard``: megatron's Adam over the adapters (plain or distributed, CPU offload) and its
  checkpoint state; ``check_for_nan_in_loss_and_grad`` (the ranks and the step named);
- ``packed`` / ``packing``: packed sequences (megatron's THD format) through KDA and MLA, and the recipe's dynamic
  batches (micro-batches filled to ``max_tokens_per_gpu``, balanced over DP ranks; its per-sample-mean loss);
- ``context_parallel`` / ``recompute``: the CP token layout and exchanges (padded and packed), megatron's
  activation recompute applied to K3's layers;
- ``checkpoint`` / ``convert``: HF and torch_dist checkpoints (``k3 convert hf-to-dist | dist-to-hf``);
- ``parallel``: the process groups (every one with the run's collective timeout);
- ``backend``: ``require_cuda`` for ``k3 train --backend megatron``.

Submodules import megatron; this package module does not, so the CLI stays light.
"""
