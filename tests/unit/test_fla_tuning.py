"""Pinned fla autotune results (k3/kernels/kda/tuning.py): Triton's autotune printout parsed into fla's config
files, the md5 entry ids fla looks up, merging, and when pinning happens (CPU; no fla or Triton needed)."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from k3.kernels.kda import tuning as fla_tuning
from k3.kernels.kda.tuning import (SHIPPED, TunedConfig, fla_config_env, gpu_dir_name, key_hash,
                                   parse_autotune_log, pin_fla_configs, recorded_folder, write_config_dir)

# Two blocks as Triton 3.6 prints them (from ci/gpu_fla_probe.py on the H200), with the candidates' lines and
# an unrelated line between them.
LOG = """\
Autotuning kernel chunk_local_cumsum_vector_kernel with config BS: 32, num_warps: 2, num_ctas: 1, num_stages: 3, maxnreg: None
Triton autotuning for function chunk_local_cumsum_vector_kernel,
with key as (16, 4, 16, 64, False, False, 'torch.float32', 'torch.float32'),
finished after 2.22s,
best config selected: BS: 32, num_warps: 8, num_ctas: 1, num_stages: 3, maxnreg: None;
{"case": "tiny_bf16_fwd", "call": 0, "seconds": 82.2762, "finite": true}
Triton autotuning for function chunk_gla_fwd_kernel_o,
with key as (64, 4, False, 16, 16, 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16'),
finished after 27.09s,
best config selected: BK: 64, BV: 64, num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None;
"""


def test_parse_reads_kernel_key_and_config():
    cumsum, gla = parse_autotune_log(LOG)
    assert cumsum == TunedConfig("chunk_local_cumsum_vector_kernel",
                                 (16, 4, 16, 64, False, False, "torch.float32", "torch.float32"), {"BS": 32},
                                 num_warps=8, num_stages=3, num_ctas=1, maxnreg=None)
    assert gla.kernel == "chunk_gla_fwd_kernel_o" and gla.kwargs == {"BK": 64, "BV": 64}
    assert (gla.num_warps, gla.num_stages) == (4, 2)
    assert gla.key[:5] == (64, 4, False, 16, 16) and gla.key[5] == "torch.bfloat16"


def test_key_hash_is_flas_md5_of_compact_sorted_json():
    key = (16, 4, 16, 64, False, False, "torch.float32", "torch.float32")
    text = '[16,4,16,64,false,false,"torch.float32","torch.float32"]'
    assert key_hash(key) == hashlib.md5(text.encode()).hexdigest() == key_hash(list(key))


def test_write_merges_entries_and_later_results_replace_earlier(tmp_path):
    first = parse_autotune_log(LOG)
    write_config_dir(first, tmp_path, {"fla-core": "0.6.0", "triton": "3.6.0"})
    again = TunedConfig(first[0].kernel, first[0].key, {"BS": 64}, num_warps=2, num_stages=3)
    other = TunedConfig(first[0].kernel, (1, 4, 16, 64, False, False, "torch.float32", "torch.float32"),
                        {"BS": 32}, num_warps=4, num_stages=3)
    written = write_config_dir([again, other], tmp_path, {"fla-core": "0.6.0", "triton": "3.6.0"})
    assert written == [tmp_path / "chunk_local_cumsum_vector_kernel.json"]
    data = json.loads(written[0].read_text())
    entries = data["autotune_entries"]
    assert set(entries) == {key_hash(first[0].key), key_hash(other.key)}
    assert entries[key_hash(first[0].key)] == {
        "autotune_key": list(first[0].key),
        "config": {"kwargs": {"BS": 64}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}
    # widest shapes first (16 + 4 + 16 + 64 against 1 + 4 + 16 + 64), and the first entry is the default
    assert list(entries) == [key_hash(first[0].key), key_hash(other.key)]
    assert data["default_config"] == {"kwargs": {"BS": 64}, "num_warps": 2, "num_stages": 3, "num_ctas": 1,
                                      "maxnreg": None}
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"fla-core": "0.6.0", "triton": "3.6.0"}
    assert (tmp_path / "chunk_gla_fwd_kernel_o.json").exists()


def test_the_widest_shapes_come_first_whatever_the_recording_order(tmp_path):
    """fla's full mode takes the first entry whose key has the same structure: a narrower shape must find the wide
    config (it fits), a wider one must never find the tiny model's (it does not fit the GPU's shared memory)."""
    tiny = TunedConfig("k", (4, 16, False, "torch.bfloat16"), {"BV": 32}, num_warps=4, num_stages=4)
    wide = TunedConfig("k", (96, 128, False, "torch.bfloat16"), {"BV": 64}, num_warps=4, num_stages=2)
    flag = TunedConfig("k", (8, 32, True, "torch.bfloat16"), {"BV": 16}, num_warps=2, num_stages=1)
    write_config_dir([tiny], tmp_path)
    write_config_dir([flag, wide], tmp_path)
    data = json.loads((tmp_path / "k.json").read_text())
    assert [e["autotune_key"][:2] for e in data["autotune_entries"].values()] == [[96, 128], [8, 32], [4, 16]]
    assert data["default_config"] == wide.as_fla_config()
    assert list(data) == ["autotune_entries", "default_config", "kernel_name"]


def test_every_shipped_file_lists_its_widest_shapes_first():
    for path in (SHIPPED / "NVIDIA_H200").glob("*.json"):
        if path.name == "manifest.json":
            continue
        data = json.loads(path.read_text())
        scales = [fla_tuning._shape_scale(e["autotune_key"]) for e in data["autotune_entries"].values()]
        assert scales == sorted(scales, reverse=True), path.name
        assert data["default_config"] == next(iter(data["autotune_entries"].values()))["config"], path.name


def test_results_of_another_fla_version_need_their_own_folder(tmp_path):
    write_config_dir(parse_autotune_log(LOG), tmp_path, {"fla-core": "0.6.0", "triton": "3.6.0"})
    with pytest.raises(ValueError, match="recorded with .*0.6.0.*new directory"):
        write_config_dir(parse_autotune_log(LOG), tmp_path, {"fla-core": "0.7.0", "triton": "3.6.0"})


@pytest.mark.parametrize("bad, match", [
    (LOG.replace("(16, 4, 16, 64,", "(16, 4, oops, 64,"), "not a Python literal"),
    (LOG.replace("BS: 32, num_warps: 8", "BS 32, num_warps: 8"), "name: value"),
    (LOG.replace("num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None;", "num_ctas: 1;"), "no num_warps"),
])
def test_unreadable_blocks_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_autotune_log(bad, "probe.log")


def test_gpu_dir_name_is_flas():
    assert gpu_dir_name("NVIDIA H200") == "NVIDIA_H200"
    assert gpu_dir_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert gpu_dir_name("--") == "unknown_gpu"


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", "K3_FLA_PINNED_CONFIGS"):
        monkeypatch.setenv(var, "")  # records the original state, so what pinning sets is undone afterwards
        monkeypatch.delenv(var)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", None)
    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache")
    monkeypatch.setattr(fla_tuning.importlib.metadata, "version", lambda name: {"fla-core": "0.6.0"}[name])
    return monkeypatch


def test_pin_points_fla_at_the_shipped_h200_folder_in_strict_mode(clean_env):
    import os

    assert pin_fla_configs("NVIDIA H200") == SHIPPED / "NVIDIA_H200"
    assert os.environ["FLA_CONFIG_DIR"] == str(SHIPPED / "NVIDIA_H200")
    assert os.environ["FLA_CACHE_MODE"] == "strict"
    recorded = json.loads((SHIPPED / "NVIDIA_H200" / "manifest.json").read_text())
    assert recorded["fla-core"] == "0.6.0"
    for path in (SHIPPED / "NVIDIA_H200").glob("*.json"):  # every shipped file is one fla accepts
        data = json.loads(path.read_text())
        if path.name != "manifest.json":
            assert data["kernel_name"] == path.stem
            assert all(key_hash(e["autotune_key"]) == h for h, e in data["autotune_entries"].items())


def test_a_gpu_of_the_same_capability_takes_the_h200_folder(clean_env):
    """An H100 (compute capability 9.0, like the H200) has no folder of its own: it runs the H200's configs rather
    than autotuning for minutes; an 8.0 card (A100) gets nothing, and the capability is only a fallback."""
    import os

    assert json.loads((SHIPPED / "NVIDIA_H200" / "manifest.json").read_text())["compute_capability"] == "9.0"
    assert pin_fla_configs("NVIDIA H100 80GB HBM3", capability="9.0") == SHIPPED / "NVIDIA_H200"
    assert (os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"]) == (str(SHIPPED / "NVIDIA_H200"), "strict")
    clean_env.delenv("FLA_CONFIG_DIR")
    clean_env.delenv("FLA_CACHE_MODE")
    assert pin_fla_configs("NVIDIA H100 80GB HBM3") is None  # no capability given: own folder only
    assert pin_fla_configs("NVIDIA A100-SXM4-80GB", capability="8.0") is None
    assert "FLA_CONFIG_DIR" not in os.environ


def test_parity_checks_get_full_mode_and_a_user_s_setting_wins(clean_env):
    """K3_FLA_PINNED_CONFIGS=full (the GPU parity workers): the same folder, every key served from it; nothing when
    the user chose, when pinning is off, or for a GPU with no recorded folder of its own or its capability."""
    import os

    folder = str(SHIPPED / "NVIDIA_H200")
    assert fla_config_env("NVIDIA H100 80GB HBM3", "9.0", "full") == {"FLA_CONFIG_DIR": folder,
                                                                       "FLA_CACHE_MODE": "full"}
    assert "FLA_CACHE_MODE" not in os.environ  # it only returns the environment
    assert fla_config_env("NVIDIA A100-SXM4-80GB", "8.0", "full") == {}
    assert fla_config_env(None, None, "full") == fla_config_env("NVIDIA H200", None, None) == {}
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", "full")
    assert pin_fla_configs("NVIDIA H100 80GB HBM3", capability="9.0") == SHIPPED / "NVIDIA_H200"
    assert (os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"]) == (folder, "full")
    clean_env.setenv("FLA_CACHE_MODE", "disabled")  # the user's (or an earlier pin's) setting is kept
    assert fla_config_env("NVIDIA H200", None, "full") == {}
    with pytest.raises(ValueError, match="'fuzzy': k3 pins 'strict' .* or 'full'"):
        fla_config_env("NVIDIA H200", None, "fuzzy")


@pytest.mark.parametrize("value, mode", [("1", "strict"), ("strict", "strict"), ("full", "full"), ("0", None)])
def test_the_pinned_mode_comes_from_the_environment(clean_env, value, mode):
    from k3.kernels.kda.tuning import pinned_mode

    assert pinned_mode() == "strict"
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", value)
    assert pinned_mode() == mode


def test_an_unknown_pinned_mode_is_a_clear_error(clean_env):
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", "yes")
    with pytest.raises(ValueError, match=r"K3_FLA_PINNED_CONFIGS='yes': expected strict .*full .*or 0"):
        pin_fla_configs("NVIDIA H200")


def test_another_fla_core_gets_no_configs(clean_env):
    clean_env.setattr(fla_tuning.importlib.metadata, "version", lambda name: "0.7.0")
    assert fla_config_env("NVIDIA H200", None, "full") == {}
    assert pin_fla_configs("NVIDIA H200") is None


def test_a_gpu_s_own_folder_wins_over_one_of_its_capability(tmp_path):
    for name, cap in (("NVIDIA_A", "9.0"), ("NVIDIA_B", "9.0"), ("NVIDIA_H100_80GB_HBM3", "9.0"), ("Other", "8.0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"fla-core": "0.6.0", "compute_capability": cap}))
    (tmp_path / "empty").mkdir()
    assert recorded_folder("NVIDIA H100 80GB HBM3", "9.0", tmp_path) == tmp_path / "NVIDIA_H100_80GB_HBM3"
    assert recorded_folder("NVIDIA H200", "9.0", tmp_path) == tmp_path / "NVIDIA_A"  # the first by name
    assert recorded_folder("NVIDIA A100", "8.0", tmp_path) == tmp_path / "Other"
    assert recorded_folder("NVIDIA A100", "7.0", tmp_path) is None
    assert recorded_folder("NVIDIA A100", "8.0", tmp_path / "missing") is None


def test_nothing_is_pinned_when_the_user_decides_or_nothing_fits(clean_env, tmp_path):
    import os

    assert pin_fla_configs(None) is None  # no GPU
    assert pin_fla_configs("NVIDIA A100-SXM4-80GB") is None  # nothing recorded for it
    clean_env.setattr(fla_tuning.importlib.metadata, "version", lambda name: "0.7.0")
    assert pin_fla_configs("NVIDIA H200") is None  # recorded with another fla-core
    clean_env.setattr(fla_tuning.importlib.metadata, "version", lambda name: "0.6.0")
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", "0")
    assert pin_fla_configs("NVIDIA H200") is None
    clean_env.delenv("K3_FLA_PINNED_CONFIGS")
    clean_env.setenv("FLA_CACHE_MODE", "disabled")
    assert pin_fla_configs("NVIDIA H200") is None and os.environ["FLA_CACHE_MODE"] == "disabled"
    clean_env.delenv("FLA_CACHE_MODE")
    clean_env.setitem(sys.modules, "fla.ops.utils.cache", object())  # too late: fla read its mode already
    assert pin_fla_configs("NVIDIA H200") is None
    assert "FLA_CONFIG_DIR" not in os.environ


def test_record_command_writes_the_folder_and_refuses_logs_without_results(tmp_path):
    from typer.testing import CliRunner

    from k3.launch.cli import _register, app

    _register()
    log = tmp_path / "probe.log"
    log.write_text(LOG)
    runner = CliRunner()
    result = runner.invoke(app, ["record-fla-tuning", str(log), "--out", str(tmp_path / "cfg"),
                                 "--fla-core", "0.6.0", "--triton", "3.6.0"])
    assert result.exit_code == 0, result.output
    assert "2 results, 2 kernels" in result.output
    assert sorted(p.name for p in (tmp_path / "cfg").iterdir()) == [
        "chunk_gla_fwd_kernel_o.json", "chunk_local_cumsum_vector_kernel.json", "manifest.json"]
    log.write_text("nothing tuned\n")
    result = runner.invoke(app, ["record-fla-tuning", str(log), "--out", str(tmp_path / "cfg2"),
                                 "--fla-core", "0.6.0", "--triton", "3.6.0"])
    assert result.exit_code == 2 and "TRITON_PRINT_AUTOTUNING=1" in result.output
    assert not (tmp_path / "cfg2").exists()
    log.write_text(LOG)
    result = runner.invoke(app, ["record-fla-tuning", str(log), "--out", str(tmp_path / "cfg3"), "--fla-core",
                                 "0.6.0", "--triton", "3.6.0", "--compute-capability", "9.0"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "cfg3" / "manifest.json").read_text()) == {
        "compute_capability": "9.0", "fla-core": "0.6.0", "triton": "3.6.0"}
    result = runner.invoke(app, ["record-fla-tuning", str(log), "--out", str(tmp_path / "cfg4"), "--fla-core",
                                 "0.6.0", "--triton", "3.6.0", "--compute-capability", "sm90"])
    assert result.exit_code == 2 and "expected MAJOR.MINOR, e.g. 9.0" in result.output
    assert not (tmp_path / "cfg4").exists()


def test_the_kda_dispatch_pins_before_importing_fla(clean_env):
    """``k3.kernels.kda.fla`` calls the pinning on a CUDA machine before its first ``import fla`` (which fails here,
    without Triton: the dispatch then reports fla as unavailable, as before)."""
    import os

    from k3.kernels.kda import fla as kda

    clean_env.setattr(kda.torch.cuda, "is_available", lambda: True)
    clean_env.setattr(kda.torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    clean_env.setattr(kda.torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    kda._fla_ops.cache_clear()
    try:
        kda._fla_ops()
        assert os.environ.get("FLA_CONFIG_DIR") == str(SHIPPED / "NVIDIA_H200")  # by its capability
        assert os.environ.get("FLA_CACHE_MODE") == "strict"
    finally:
        kda._fla_ops.cache_clear()
