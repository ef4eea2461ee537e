"""The trainer's memory saver and megatron-core in the order a trainer rank meets them (CPU, gloo, one process).

A trainer worker loads torch_memory_saver (``trainer_regions``) before megatron-core is imported; megatron-core's
inference contexts set the saver's hook mode when imported, and the saver refuses that once it is initialised. The
worker (this file as a script) puts :class:`lazy_saver.LazySaver` in the saver's place, loads the regions as the
worker does, then imports megatron (``megatron_compat.install``) and builds the policy inside the regions, and
sleeps once: everything must go through, with megatron's hook mode taken before the saver's first use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from layout_parity import trajectories

RANK, ALPHA, MAX_TOKENS = 4, 8.0, 24


def _worker(root: Path) -> dict:
    from lazy_saver import install_lazy_saver

    saver = install_lazy_saver()
    assert "megatron.core" not in sys.modules, "megatron was imported before the saver was loaded"
    from k3.rl.trainers.memory_regions import trainer_regions

    regions = trainer_regions(True, "cuda")  # the CUDA path's regions; the stand-in needs no device
    out: dict = {"initialised_at_load": saver._impl is not None}

    import megatron_compat
    from tiny_checkpoint import write_tiny_checkpoint

    megatron_compat.install()  # imports megatron-core: its inference contexts set the hook mode here
    from k3.lora import LoRAConfig
    from k3.rl.trainers.megatron import build_megatron_policy

    policy = build_megatron_policy(write_tiny_checkpoint(root), LoRAConfig(rank=RANK, alpha=ALPHA), pad_id=0,
                                   max_tokens_per_micro_batch=MAX_TOKENS, seed=3, regions=regions)
    out["impl"] = saver._impl
    out["regions"] = saver.regions
    out["log_probs"] = len(policy.log_probs(trajectories(policy.cfg.vocab_size)))
    policy.grad_buffers().release(regions)
    out["paused"], out["retained"] = saver.paused, saver.retained
    policy.close()
    return out


if __name__ == "__main__":
    from megatron_compat import save_result

    save_result(_worker(Path(sys.argv[1])), sys.argv[1])


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_compat import worker_result

    tmp = tmp_path_factory.mktemp("megatron_saver_order")
    return worker_result([__file__, str(tmp)], tmp)


def test_loading_the_saver_does_not_initialise_it(result):
    assert result["initialised_at_load"] is False


def test_megatron_sets_the_hook_mode_before_the_policy_is_built_inside_the_regions(result):
    assert result["impl"] == {"hook_mode": "torch"}
    assert result["regions"][:2] == ["default", "grad_buffer"] and result["log_probs"] > 0


def test_the_first_pause_keeps_the_saver_s_backups(result):
    assert result["paused"] == ["grad_buffer"] and result["retained"] is True
