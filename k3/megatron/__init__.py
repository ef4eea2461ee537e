"""Megatron-core backend of K3 (megatron-core 0.16.1, no TransformerEngine needed).

- ``config``: ``k3_transformer_config`` (TransformerConfig of K3 for a TP/EP/PP layout);
- ``spec`` / ``model``: ``get_k3_spec`` (the layers of a pipeline stage) and ``k3_model_provider`` (GPTModel);
- ``kda`` / ``mla`` / ``mlp`` / ``moe`` / ``layer``: K3's modules on megatron's parallel linears, router and
  token dispatcher, with the reference model's math (``k3.model``);
- ``lora`` / ``grads`` / ``training``: adapters under TP/EP, their gradient reductions, a LoRA training step;
- ``packed`` / ``packing``: packed sequences (megatron's THD format) through KDA and MLA, and the recipe's dynamic
  batches (micro-batches filled to ``max_tokens_per_gpu``, balanced over DP ranks; its per-sample-mean loss);
- ``context_parallel`` / ``recompute``: the CP token layout and exchanges (padded and packed), megatron's
  activation recompute applied to K3's layers;
- ``checkpoint`` / ``convert``: HF and torch_dist checkpoints (``k3 convert hf-to-dist | dist-to-hf``);
- ``backend``: ``require_cuda`` for ``k3 train --backend megatron``.

Submodules import megatron; this package module does not, so the CLI stays light.
"""
