"""What the ordinary CUDA caching allocator holds outside the private pools (k3/transport/device_memory.py
``default_pool_usage``), from a snapshot in torch's format; and the trainer's readings carry it only on CUDA."""

from __future__ import annotations

import pytest
import torch

from k3.transport.device_memory import GIB, default_pool_usage

MIB = 2**20


def _segment(device: int, pool: tuple[int, int], total: int, blocks: list[tuple[int, str]]) -> dict:
    return {"device": device, "segment_pool_id": pool, "total_size": total,
            "blocks": [{"size": size, "state": state} for size, state in blocks]}


def test_only_the_default_pool_of_the_device_counts_and_the_largest_live_blocks_are_named(monkeypatch):
    snapshot = [
        _segment(0, (0, 0), 600 * MIB, [(300 * MIB, "active_allocated"), (300 * MIB, "inactive")]),
        _segment(0, (0, 0), 20 * MIB, [(2 * MIB, "active_allocated"), (1 * MIB, "active_pending_free"),
                                        (17 * MIB, "inactive")]),
        _segment(0, (1, 7), 12 * 1024 * MIB, [(12 * 1024 * MIB, "active_allocated")]),  # a saver region's pool
        _segment(1, (0, 0), 64 * MIB, [(64 * MIB, "active_allocated")]),  # another device
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    got = default_pool_usage(torch.device("cuda", 0))
    assert got["memory/default_pool_allocated_gb"] == pytest.approx(302 * MIB / GIB, abs=0)
    assert got["memory/default_pool_reserved_gb"] == pytest.approx(620 * MIB / GIB, abs=0)
    assert got["default_pool_largest_mb"] == [300.0, 2.0]


def test_a_snapshot_without_pool_ids_is_all_default_pool(monkeypatch):
    seg = _segment(0, (0, 0), 8 * MIB, [(4 * MIB, "active_allocated")])
    del seg["segment_pool_id"]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [seg])
    got = default_pool_usage(torch.device("cuda", 0))
    assert got["memory/default_pool_reserved_gb"] == 8 * MIB / GIB


def test_only_a_cuda_trainer_with_the_saver_s_regions_reads_its_pools(monkeypatch):
    from types import SimpleNamespace

    from k3.rl.trainers import memory_regions
    from k3.rl.trainers.memory_regions import HostRegions, ParamGrads, TrainerMemory

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(memory_regions, "default_pool_usage", lambda device: pytest.fail("read on CPU"))
    memory = TrainerMemory(HostRegions(), model, ParamGrads(model.parameters()), "cpu")
    assert not any(k.startswith("memory/default_pool") for k in memory.reading("before_offload"))

    usage = {"memory/default_pool_allocated_gb": 0.5, "memory/default_pool_reserved_gb": 1.25,
             "default_pool_largest_mb": [512.0]}
    monkeypatch.setattr(memory_regions, "default_pool_usage", lambda device: usage)
    monkeypatch.setattr(memory_regions, "memory_reading", lambda phase, device, resident, **kw: {"phase": phase})
    saver = SimpleNamespace(region=None, pause=None, resume=None, get_cpu_backup=None)
    memory = TrainerMemory(memory_regions.SaverRegions(saver), model, ParamGrads(model.parameters()), "cuda")
    assert memory.reading("before_offload") == {"phase": "before_offload", **usage}
