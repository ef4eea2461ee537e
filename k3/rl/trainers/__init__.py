"""The trainers of GRPO on the LoRA adapters, one per backend, with one interface (``log_probs``, ``train_step``,
optimizer state): ``torch`` (``PolicyTrainer``, plain PyTorch, one rank), ``megatron`` (``MegatronPolicy``,
megatron-core under TP/EP/PP/CP) and ``group`` (a multi-rank megatron trainer driven as one handle); both take
``trajectory.Trajectory``s. ``log_probs``: the torch backend's chunked log-softmax (``log_probs_chunk_size``)."""
