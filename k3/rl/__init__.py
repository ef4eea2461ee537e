"""RL building blocks: prompt data (``data``, ``arith``), XTML prompts (``chat``), rewards (``reward``), GRPO
(``grpo``). Modules are imported where used; this package imports nothing heavy (the math-verify worker
starts its child process as ``python -m k3.rl.math_verify_worker``)."""
