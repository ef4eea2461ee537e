"""k3.checkpoint.hf_io.read_weight_map: every shard of the index is checked once, however many tensors it holds."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file
import torch

from k3.checkpoint import hf_io
from k3.checkpoint.hf_io import INDEX_NAME, CheckpointError, read_weight_map


def _index_of(tmp_path, n_tensors: int, shards: list[str]):
    for shard in shards:
        save_file({"x": torch.zeros(1)}, str(tmp_path / shard))
    wm = {f"t.{i}": shards[i % len(shards)] for i in range(n_tensors)}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


def test_each_shard_path_is_resolved_once(tmp_path, monkeypatch):
    wm = _index_of(tmp_path, 5000, ["a.safetensors", "b.safetensors"])
    calls = []
    real = hf_io._safe_child
    monkeypatch.setattr(hf_io, "_safe_child", lambda *a: calls.append(a[1]) or real(*a))
    assert read_weight_map(tmp_path) == wm
    assert sorted(calls) == ["a.safetensors", "b.safetensors"]


def test_a_missing_shard_names_a_tensor_in_it(tmp_path):
    _index_of(tmp_path, 10, ["a.safetensors"])
    data = json.loads((tmp_path / INDEX_NAME).read_text())
    data["weight_map"]["t.3"] = "gone.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tensor 't.3' is in shard 'gone.safetensors', which does not exist"):
        read_weight_map(tmp_path)


def test_a_shard_that_is_not_a_name_is_refused(tmp_path):
    _index_of(tmp_path, 2, ["a.safetensors"])
    data = json.loads((tmp_path / INDEX_NAME).read_text())
    data["weight_map"]["t.1"] = ["a.safetensors"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"shard name \['a.safetensors'\] is not a file name"):
        read_weight_map(tmp_path)
