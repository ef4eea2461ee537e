"""Shared test setup: GPU/cluster markers skip cleanly without the hardware; CPU threads kept small."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

FAKE_SGLANG = Path(__file__).resolve().parent / "fake_sglang"

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


@pytest.fixture
def fake_sglang(monkeypatch):
    """The fake ``sglang`` (tests/fake_sglang) importable, first on sys.path so spawned ranks see it too, its
    timeline empty; removed from sys.modules after. Skips where a real sglang is installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is not None and FAKE_SGLANG not in Path(spec.origin or "").parents:
        pytest.skip("a real sglang is installed here; these tests drive the fake one")
    monkeypatch.syspath_prepend(str(FAKE_SGLANG))
    sglang = importlib.import_module("sglang")
    sglang.TIMELINE.clear()
    sglang.ENGINES.clear()
    yield sglang
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
