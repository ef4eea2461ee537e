"""``k3 convert mxfp4-to-bf16``: exact output, workers, verify, every bad input, and kill/resume in a real process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from k3.checkpoint import convert as convert_mod
from k3.checkpoint.convert import (
    MANIFEST_NAME,
    SLOW_SHARD_ENV,
    convert_mxfp4_to_bf16,
    staging_dir,
    verify_conversion,
)
from k3.checkpoint.hf_io import INDEX_NAME, CheckpointError, load_state_dict, read_safetensors_header
from k3.checkpoint.synth import write_synthetic_checkpoint
from k3.config import variant
from k3.launch.checkpoint_commands import convert_app

SEED = 5
SHARD = 60_000  # bytes: the tiny checkpoint (~1 MB) spreads over many shards


def tree_hashes(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    """A tiny MXFP4 checkpoint in many shards, with tokenizer-like files beside it."""
    root = tmp_path_factory.mktemp("convert")
    src = write_synthetic_checkpoint(variant("tiny"), root / "native", "mxfp4", seed=SEED, max_shard_size=SHARD,
                                     progress=False)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')
    (src / "tiktoken.model").write_bytes(b"\x00ranks\xff")
    (src / "extra").mkdir()
    (src / "extra" / "chat_template.txt").write_text("{{ messages }}")
    (src / ".cache").mkdir()
    (src / ".cache" / "junk").write_text("not copied")
    return src


@pytest.fixture(scope="module")
def converted(native, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "bf16"
    convert_mxfp4_to_bf16(native, out, progress=False)
    return out


def shards_of(d: Path) -> list[str]:
    return sorted(set(json.loads((d / INDEX_NAME).read_text())["weight_map"].values()))


def edit_shard(d: Path, shard: str, fn) -> None:
    tensors = load_file(d / shard)
    fn(tensors)
    save_file(tensors, d / shard, metadata={"format": "pt"})


def patch_tensor_bytes(path: Path, name: str, offset: int, data: bytes) -> bytes:
    """Overwrite bytes of one tensor in place (the file's layout is untouched); returns the old bytes."""
    e = read_safetensors_header(path).entries[name]
    assert offset + len(data) <= e.nbytes
    with open(path, "r+b") as f:
        f.seek(e.begin + offset)
        old = f.read(len(data))
        f.seek(e.begin + offset)
        f.write(data)
    return old


def edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX_NAME).read_text())
    fn(index["weight_map"])
    (d / INDEX_NAME).write_text(json.dumps(index))


def a_scale(d: Path, n: int = 0) -> tuple[str, str]:
    """(shard, name) of the n-th weight_scale in the index."""
    wm = json.loads((d / INDEX_NAME).read_text())["weight_map"]
    name = sorted(k for k in wm if k.endswith(".weight_scale"))[n]
    return wm[name], name


@pytest.fixture
def broken(native, tmp_path) -> Path:
    """A private copy of the native checkpoint to damage."""
    return Path(shutil.copytree(native, tmp_path / "broken"))


# ------------------------------------------------------------------------------------------------ good input
def test_output_is_the_bf16_checkpoint_of_the_same_seed(converted, tmp_path):
    ref = write_synthetic_checkpoint(variant("tiny"), tmp_path / "ref", "bf16", seed=SEED, progress=False)
    got, want = load_state_dict(converted, strip_prefix=None), load_state_dict(ref, strip_prefix=None)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert json.loads((converted / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    index = json.loads((converted / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == json.loads((ref / INDEX_NAME).read_text())["metadata"]["total_size"]


def test_copied_tensors_are_bit_exact_and_files_carried_over(native, converted):
    src = load_state_dict(native, strip_prefix=None)
    out = load_state_dict(converted, strip_prefix=None)
    for k, v in src.items():
        if not k.endswith((".weight_packed", ".weight_scale")):
            assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    assert shards_of(converted) == shards_of(native)  # same file names, tensors stay in their shard
    assert (converted / "tokenizer_config.json").read_text() == '{"model_max_length": 4096}\n'
    assert (converted / "tiktoken.model").read_bytes() == b"\x00ranks\xff"
    assert (converted / "extra" / "chat_template.txt").read_text() == "{{ messages }}"
    assert not (converted / ".cache").exists() and not (converted / MANIFEST_NAME).exists()
    assert not staging_dir(converted).exists()
    cfg = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in cfg and "quantization_config" not in cfg["text_config"]


def test_workers_and_verify_give_the_same_bytes(native, converted, tmp_path):
    out = tmp_path / "w2"
    r = convert_mxfp4_to_bf16(native, out, workers=2, verify=True, progress=False)
    assert r.verified and r.shards_converted == len(shards_of(native)) and r.shards_reused == 0
    assert tree_hashes(out) == tree_hashes(converted)
    assert r.shard_crc32 == {s: f"{zlib.crc32((out / s).read_bytes()):08x}" for s in shards_of(out)}


def test_a_scale_in_another_shard_is_found(broken, converted, tmp_path):
    shard, name = a_scale(broken, 3)
    other = next(s for s in shards_of(broken) if s != shard)
    moved = {}
    edit_shard(broken, shard, lambda t: moved.update({name: t.pop(name)}))
    edit_shard(broken, other, lambda t: t.update(moved))
    edit_index(broken, lambda wm: wm.update({name: other}))
    out = tmp_path / "o"
    convert_mxfp4_to_bf16(broken, out, verify=True, progress=False)
    got, want = load_state_dict(out, strip_prefix=None), load_state_dict(converted, strip_prefix=None)
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())


def test_verify_catches_a_changed_byte(native, converted, tmp_path):
    verify_conversion(native, converted, progress=False)
    out = Path(shutil.copytree(converted, tmp_path / "c"))
    wm = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    expert = next(k for k in sorted(wm) if k.endswith("experts.1.w2.weight"))
    patch_tensor_bytes(out / wm[expert], expert, 6, torch.tensor([7.0], dtype=torch.bfloat16).view(torch.uint8)
                       .numpy().tobytes())
    with pytest.raises(CheckpointError, match=rf"tensor '{expert}': differs from the MXFP4 decode"):
        verify_conversion(native, out, progress=False)
    shutil.rmtree(out)
    out = Path(shutil.copytree(converted, tmp_path / "c"))
    norm = next(k for k in sorted(wm) if k.endswith("layers.2.input_layernorm.weight"))
    patch_tensor_bytes(out / wm[norm], norm, 0, b"\x00\x40")  # 1.0 -> 2.0
    with pytest.raises(CheckpointError, match=rf"tensor '{norm}': bytes differ from the source"):
        verify_conversion(native, out, progress=False)
    (out / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: missing or different"):
        verify_conversion(native, out, progress=False)


def test_verify_checks_the_released_layout(broken, tmp_path):
    # A source that converts fine but is not K3's layout (an extra text tensor) fails --verify, not the conversion.
    shard = shards_of(broken)[0]
    edit_shard(broken, shard, lambda t: t.update({"language_model.model.extra.weight": torch.zeros(2)}))
    edit_index(broken, lambda wm: wm.update({"language_model.model.extra.weight": shard}))
    out = tmp_path / "o"
    convert_mxfp4_to_bf16(broken, out, progress=False)
    with pytest.raises(CheckpointError, match=r"differ from the released K3 layout .*unexpected "
                                              r"\['language_model.model.extra.weight'\]"):
        verify_conversion(broken, out, progress=False)


def test_verify_checks_the_manifest_checksum(native, converted):
    plan = convert_mod.plan_conversion(native)
    shard = plan.shards[0]
    good = f"{zlib.crc32((converted / shard.name).read_bytes()):08x}"
    convert_mod._verify_shard(native, converted, shard, good, lambda n: None)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: crc32 {good} differs from the manifest's 00000000"):
        convert_mod._verify_shard(native, converted, shard, "00000000", lambda n: None)


def test_failed_verification_removes_the_partial_output(native, tmp_path, monkeypatch):
    def bad(*args, **kwargs):
        raise CheckpointError("shard X: tensor 'y': differs")

    monkeypatch.setattr(convert_mod, "_verify_shard", bad)
    out = tmp_path / "v"
    with pytest.raises(CheckpointError, match="verification failed: shard X"):
        convert_mxfp4_to_bf16(native, out, verify=True, progress=False)
    assert not out.exists() and not staging_dir(out).exists()


def test_overwrite(native, converted, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="exists and is not empty; pass --overwrite"):
        convert_mxfp4_to_bf16(native, out, progress=False)
    assert (out / "old.txt").read_text() == "old" and not staging_dir(out).exists()
    convert_mxfp4_to_bf16(native, out, overwrite=True, progress=False)
    assert tree_hashes(out) == tree_hashes(converted)
    (tmp_path / "empty").mkdir()
    convert_mxfp4_to_bf16(native, tmp_path / "empty", progress=False)  # an empty folder is fine
    assert tree_hashes(tmp_path / "empty") == tree_hashes(converted)


# ------------------------------------------------------------------------------------------------ bad input
def expect_refusal(src: Path, out: Path, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        convert_mxfp4_to_bf16(src, out, progress=False)
    assert not out.exists()


def test_packed_weight_without_its_scale(broken, tmp_path):
    shard, name = a_scale(broken)
    edit_shard(broken, shard, lambda t: t.pop(name))
    edit_index(broken, lambda wm: wm.pop(name))
    packed = name.replace("_scale", "_packed")
    expect_refusal(broken, tmp_path / "o", rf"{shard}: tensor '{packed}': packed weight without its scale")
    assert not staging_dir(tmp_path / "o").exists()  # refused before anything was written


def test_scale_without_its_packed_weight(broken, tmp_path):
    shard, name = a_scale(broken)
    packed = name.replace("_scale", "_packed")
    edit_shard(broken, json.loads((broken / INDEX_NAME).read_text())["weight_map"][packed], lambda t: t.pop(packed))
    edit_index(broken, lambda wm: wm.pop(packed))
    expect_refusal(broken, tmp_path / "o", rf"tensor '{name}': a scale without its packed weight")


def test_scale_shape_mismatch(broken, tmp_path):
    shard, name = a_scale(broken, 1)

    def widen(t):
        t[name] = torch.cat([t[name], t[name][:, :1]], dim=1)

    edit_shard(broken, shard, widen)
    expect_refusal(broken, tmp_path / "o", rf"{shard}: tensor '{name}': scale shape mismatch: \[\d+, \d+\], but")


@pytest.mark.parametrize("damage, pattern", [
    ("truncate", r"truncated: the header describes \d+ bytes, the file has \d+"),
    ("header", r"corrupt safetensors header, not valid JSON"),
    ("length", r"truncated or corrupt: header length \d+ does not fit the file"),
    ("trailing", r"corrupt: 3 trailing bytes after the last tensor"),
])
def test_truncated_or_corrupt_shard(broken, tmp_path, damage, pattern):
    shard = shards_of(broken)[2]
    path = broken / shard
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "header":
        data[9:20] = b"\x00garbage!!\xff"
    elif damage == "length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    else:
        data += b"abc"
    path.write_bytes(bytes(data))
    expect_refusal(broken, tmp_path / "o", rf"{shard}: {pattern}")


def test_index_naming_a_missing_shard(broken, tmp_path):
    name = sorted(json.loads((broken / INDEX_NAME).read_text())["weight_map"])[7]
    edit_index(broken, lambda wm: wm.update({name: "model-00099-of-00099.safetensors"}))
    expect_refusal(broken, tmp_path / "o", rf"tensor '{name}' is in shard 'model-00099-of-00099.safetensors', "
                                           "which does not exist")


@pytest.mark.parametrize("shard, pattern", [("../outside.safetensors", "escapes the model directory"),
                                            ("/etc/passwd", "is absolute")])
def test_index_path_escaping_the_model_dir(broken, tmp_path, shard, pattern):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    name = sorted(json.loads((broken / INDEX_NAME).read_text())["weight_map"])[0]
    edit_index(broken, lambda wm: wm.update({name: shard}))
    expect_refusal(broken, tmp_path / "o", rf"{INDEX_NAME} \[{name}\]: shard path '{shard}' {pattern}")


def test_nan_scale_byte_names_file_and_tensor_and_resume_after_the_fix(broken, converted, tmp_path):
    shards = shards_of(broken)
    wm = json.loads((broken / INDEX_NAME).read_text())["weight_map"]
    with_scales = [sh for sh in shards if any(s == sh and k.endswith(".weight_scale") for k, s in wm.items())]
    shard = with_scales[len(with_scales) // 2]
    name = sorted(k for k, s in wm.items() if s == shard and k.endswith(".weight_scale"))[0]
    n_scales = read_safetensors_header(broken / shard).entries[name].shape[1]
    orig = patch_tensor_bytes(broken / shard, name, n_scales, b"\xff")  # row 1, block 0
    out = tmp_path / "o"
    packed = name.replace("_scale", "_packed")
    expect_refusal(broken, out, rf"{shard}: tensor '{packed}': weight_scale\[1, 0\] = 255 \(0xFF\): NaN in E8M0")
    staging = staging_dir(out)
    manifest = json.loads((staging / MANIFEST_NAME).read_text())
    assert set(manifest["shards"]) == set(shards[: shards.index(shard)])  # the earlier shards are kept
    assert not list(staging.glob("*.partial"))
    patch_tensor_bytes(broken / shard, name, n_scales, orig)
    r = convert_mxfp4_to_bf16(broken, out, progress=False)
    k = shards.index(shard)
    assert r.shards_reused == k and r.shards_converted == len(shards) - k
    assert tree_hashes(out) == tree_hashes(converted)


def test_already_bf16(converted, tmp_path):
    expect_refusal(converted, tmp_path / "o", r"config.json: no quantization_config: the checkpoint is already BF16")


def test_save_dir_must_differ_from_the_model_dir(native):
    with pytest.raises(CheckpointError, match="is the model dir"):
        convert_mxfp4_to_bf16(native, native, progress=False)
    with pytest.raises(CheckpointError, match="is inside the model dir"):
        convert_mxfp4_to_bf16(native, native / "bf16", progress=False)


def test_a_second_conversion_into_the_same_dir_is_refused(native, tmp_path):
    out = tmp_path / "o"
    staging = staging_dir(out)
    staging.mkdir()
    held = convert_mod._lock(staging, out)
    try:
        with pytest.raises(CheckpointError, match="another conversion into .* is running"):
            convert_mxfp4_to_bf16(native, out, progress=False)
    finally:
        os.close(held)
    convert_mxfp4_to_bf16(native, out, progress=False)
    assert (out / INDEX_NAME).exists()


def test_cli_reports_errors_and_success(native, converted, tmp_path):
    runner = CliRunner()
    r = runner.invoke(convert_app, ["mxfp4-to-bf16", "--model-dir", str(converted), "--save-dir",
                                    str(tmp_path / "x"), "--no-progress"])
    assert r.exit_code == 1 and "error: " in r.output and "already BF16" in r.output
    r = runner.invoke(convert_app, ["mxfp4-to-bf16", "--model-dir", str(native), "--save-dir", str(tmp_path / "y"),
                                    "--no-progress"])
    assert r.exit_code == 0 and f"wrote {tmp_path / 'y'}: {len(shards_of(native))} shards converted" in r.output


# ------------------------------------------------------------------------------------------------ kill and resume
def test_kill_then_resume_is_byte_identical(native, converted, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "k3", "convert", "mxfp4-to-bf16", "--model-dir", str(native),
           "--save-dir", str(out), "--workers", "2", "--no-progress"]
    env = {**os.environ, SLOW_SHARD_ENV: "0.3"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    manifest = staging_dir(out) / MANIFEST_NAME
    n_shards = len(shards_of(native))
    deadline = time.monotonic() + 60
    finished = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            finished = len(json.loads(manifest.read_text())["shards"])
        except (OSError, ValueError):
            finished = 0
        if finished >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stdout.read().decode()
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive  # the workers die with the converter
    assert not out.exists()  # nothing half-written at the target
    done_before = len(json.loads(manifest.read_text())["shards"])
    assert 3 <= done_before < n_shards

    r = subprocess.run(cmd[:-3] + ["--workers", "1", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"{done_before} reused from an interrupted run" in r.stdout
    assert tree_hashes(out) == tree_hashes(converted)
    assert not staging_dir(out).exists()
