"""Rewards of a rollout's responses: ``reward`` (the recipe's reward functions by name) and
``math_verify_worker`` (math-verify in a child process with a hard deadline, which ``reward`` grades with)."""
