"""Prompt data of a run: ``chat`` (K3's XTML prompts), ``records`` (reading, validating and writing prompt
records), ``arith`` (the smoke's generated task), ``prepare`` (each task's files under the data dir, fetched or
generated: ``k3 prepare-data``) and ``order`` (which records each rollout uses)."""
