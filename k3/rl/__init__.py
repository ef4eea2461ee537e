"""LoRA GRPO on K3, one concept per module: ``grpo`` (the algorithm: advantages, loss, optimizer), ``reward/``
(rewards), ``data/`` (prompts: records, chat format, tasks, order), ``trainers/`` (the torch and megatron
trainers, a multi-rank trainer group), ``trainer_worker`` (the trainer's worker of one rank, the adapter
hand-off's sender), ``colocate`` (the order trainer and engines hand memory over), ``handles`` (in-process or
Ray workers behind one facade), ``engines`` (the run's rollout engines from the loop's side), ``loop`` (the
loop), ``resume`` (adapter checkpoints), ``metrics`` (the run directory's event stream), ``warmup`` (the
smoke's supervised warm-up). This package imports nothing heavy (the math-verify worker starts its child
process as ``python -m k3.rl.reward.math_verify_worker``)."""
