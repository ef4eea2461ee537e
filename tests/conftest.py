"""Shared test setup: GPU/cluster markers skip cleanly without the hardware; CPU threads kept small."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    cluster_run = config.getoption("--k3-run", default=None) or os.environ.get("K3_CLUSTER_RUN")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cluster = pytest.mark.skip(reason="needs a configured cluster run (--k3-run RUN or K3_CLUSTER_RUN)")
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("cluster") and not cluster_run:
            item.add_marker(skip_cluster)


@pytest.fixture(scope="session")
def checkpoint_pair(tmp_path_factory):
    """The recipe's pairing in tiny (``tests/checkpoint_pair.py``): native MXFP4, its BF16 and torch_dist
    conversions; made once per session (about 10 s: the torch_dist conversion runs under torchrun)."""
    pytest.importorskip("megatron.core", reason="k3 convert hf-to-dist needs megatron-core")
    from checkpoint_pair import make_checkpoint_pair

    return make_checkpoint_pair(tmp_path_factory.mktemp("checkpoint_pair"))
