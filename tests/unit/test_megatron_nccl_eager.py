"""NCCL communicators are made at start, not at a group's first collective (k3/megatron/parallel.py): on the H200
under the `make smoke-gpu` budget, the lazy one inside the first training step failed with "Failed to CUDA calloc
async 4 bytes". Checked here without a GPU: under NCCL the world group is bound to the rank's device, which makes
torch connect it and every later group (megatron's) eagerly; gloo is left unbound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from k3.megatron import parallel  # noqa: E402
from k3.settings.parallel import ParallelLayout  # noqa: E402


@pytest.mark.parametrize("backend, bound", [("nccl", torch.device("cuda", 3)), ("gloo", None)])
def test_init_parallel_binds_the_rank_device_only_under_nccl(monkeypatch, backend, bound):
    got = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    dist = parallel.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: got.update(init=kw))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: got.update(set_device=i))
    monkeypatch.setattr(parallel.parallel_state, "initialize_model_parallel", lambda **kw: None)
    monkeypatch.setattr(parallel.parallel_state, "get_expert_data_parallel_group_gloo",
                        lambda: SimpleNamespace(set_timeout=lambda t: None))

    parallel.init_parallel(ParallelLayout(), seed=None, backend=backend, distributed_timeout_minutes=2)
    assert got["init"].get("device_id") == bound and got["init"]["backend"] == backend
    assert got["init"]["timeout"].total_seconds() == 120
    assert got.get("set_device") == (3 if backend == "nccl" else None)
