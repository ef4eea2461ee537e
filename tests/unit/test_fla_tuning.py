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
    """Files list the widest shapes first, whatever order they were recorded in, and the first is the default (what
    fla's own full mode would take first, should a user set it)."""
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


def test_parity_checks_get_cover_mode_and_a_user_s_setting_wins(clean_env):
    """K3_FLA_PINNED_CONFIGS=cover (the GPU parity workers): the same folder in fla's strict mode (k3 widens the
    lookup itself once fla is imported); nothing when the user chose, when pinning is off, or for a GPU with no
    recorded folder of its own or its capability."""
    import os

    folder = str(SHIPPED / "NVIDIA_H200")
    assert fla_config_env("NVIDIA H100 80GB HBM3", "9.0", "cover") == {"FLA_CONFIG_DIR": folder,
                                                                        "FLA_CACHE_MODE": "strict"}
    assert "FLA_CACHE_MODE" not in os.environ  # it only returns the environment
    assert fla_config_env("NVIDIA A100-SXM4-80GB", "8.0", "cover") == {}
    assert fla_config_env(None, None, "cover") == fla_config_env("NVIDIA H200", None, None) == {}
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", "cover")
    assert pin_fla_configs("NVIDIA H100 80GB HBM3", capability="9.0") == SHIPPED / "NVIDIA_H200"
    assert (os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"]) == (folder, "strict")
    clean_env.setenv("FLA_CACHE_MODE", "disabled")  # the user's (or an earlier pin's) setting is kept
    assert fla_config_env("NVIDIA H200", None, "cover") == {}
    with pytest.raises(ValueError, match="'full': k3 pins 'strict' .* or 'cover'"):
        fla_config_env("NVIDIA H200", None, "full")


@pytest.mark.parametrize("value, mode", [("1", "strict"), ("strict", "strict"), ("cover", "cover"), ("0", None)])
def test_the_pinned_mode_comes_from_the_environment(clean_env, value, mode):
    from k3.kernels.kda.tuning import pinned_mode

    assert pinned_mode() == "strict"
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", value)
    assert pinned_mode() == mode


def test_an_unknown_pinned_mode_is_a_clear_error(clean_env):
    clean_env.setenv("K3_FLA_PINNED_CONFIGS", "full")
    with pytest.raises(ValueError, match=r"K3_FLA_PINNED_CONFIGS='full': expected strict .*cover .*or 0"):
        pin_fla_configs("NVIDIA H200")


# The tiny model's and a K3-width entry of the dhu backward kernel, as recorded (H, Hv, K, V, BT, flags, dtypes).
TINY_KEY = [4, 4, 16, 16, 64, False, False, "torch.bfloat16", "torch.float32"]
WIDE_KEY = [96, 96, 128, 128, 64, False, False, "torch.bfloat16", "torch.float32"]
ENTRIES = {"t": {"autotune_key": TINY_KEY, "config": {"kwargs": {"BV": 32}, "num_stages": 4, "num_warps": 4}},
           "w": {"autotune_key": WIDE_KEY, "config": {"kwargs": {"BV": 64}, "num_stages": 2, "num_warps": 4}}}


@pytest.mark.parametrize("key, expected", [
    ([4, 4, 16, 16, 64, False, False, "torch.bfloat16", "torch.float32"], "t"),  # recorded: its own
    ([2, 2, 16, 16, 64, False, False, "torch.bfloat16", "torch.float32"], "t"),  # narrower: the narrowest cover
    ([8, 8, 32, 32, 64, False, False, "torch.bfloat16", "torch.float32"], "w"),  # between: only the wide covers
    ([8, 8, 128, 128, 64, False, False, "torch.bfloat16", "torch.float32"], "w"),  # the packed test's slice
    ([128, 128, 128, 128, 64, False, False, "torch.bfloat16", "torch.float32"], None),  # wider than any recorded
    ([8, 8, 128, 128, 64, True, False, "torch.bfloat16", "torch.float32"], None),  # another flag
    ([8, 8, 128, 128, 64, False, False, "torch.float32", "torch.float32"], None),  # another dtype
    ([8, 8, 128, 128, 64, False, False, "torch.bfloat16"], None),  # another structure
])
def test_a_key_takes_the_narrowest_recorded_key_that_covers_it(key, expected):
    from k3.kernels.kda.tuning import covering_entry

    found = covering_entry(ENTRIES, key)
    assert found is (None if expected is None else ENTRIES[expected])


class _FakeCache:
    """What use_covering_configs needs of fla.ops.utils.cache: its exact lookup, its config folder and its reader
    (None for a missing file, as fla's)."""

    def __init__(self, folder):
        self.folder, self.exact_calls = folder, []

    def get_fla_config_dir(self):
        return self.folder

    def read_config_file(self, path):
        return json.loads(path.read_text()) if path.exists() else None

    def load_cached_config(self, kernel_name, autotune_key=None):
        self.exact_calls.append(kernel_name)
        return {"exact": True} if kernel_name == "exact_kernel" else None


def test_the_covering_lookup_widens_fla_s_exact_one(tmp_path):
    from types import SimpleNamespace

    from k3.kernels.kda.tuning import use_covering_configs

    (tmp_path / "dhu.json").write_text(json.dumps({"kernel_name": "dhu", "autotune_entries": ENTRIES}))
    cache = _FakeCache(tmp_path)
    use_covering_configs(cache)
    use_covering_configs(cache)  # once only: a second call does not wrap the wrapper
    request = SimpleNamespace(autotune_key=(8, 8, 128, 128, 64, False, False, "torch.bfloat16", "torch.float32"))
    assert cache.load_cached_config("dhu", request) == ENTRIES["w"]["config"]
    assert cache.load_cached_config("exact_kernel", request) == {"exact": True}  # an exact hit is fla's own
    wider = SimpleNamespace(autotune_key=(128, 128, 256, 256, 64, False, False, "torch.bfloat16", "torch.float32"))
    assert cache.load_cached_config("dhu", wider) is None  # nothing covers it: fla autotunes
    assert cache.load_cached_config("unrecorded", request) is None  # no file for that kernel
    assert cache.exact_calls == ["dhu", "exact_kernel", "dhu", "unrecorded"]


def test_the_shipped_configs_cover_the_tiny_model_s_packed_backward():
    """The key a fresh H100 autotuned for 16 s in the recipe's pairing loop: the tiny model's packed (varlen) dhu
    backward, now served by the K3-width varlen entry of the same dtypes."""
    from k3.kernels.kda.tuning import covering_entry

    data = json.loads((SHIPPED / "NVIDIA_H200" / "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64.json").read_text())
    varlen = [e["autotune_key"] for e in data["autotune_entries"].values() if e["autotune_key"][-1] == "torch.int64"]
    assert varlen
    for wide in varlen:
        tiny = [4, 4, 16, 16, *wide[4:]]
        assert covering_entry(data["autotune_entries"], tiny)["autotune_key"] == wide


def test_another_fla_core_gets_no_configs(clean_env):
    clean_env.setattr(fla_tuning.importlib.metadata, "version", lambda name: "0.7.0")
    assert fla_config_env("NVIDIA H200", None, "cover") == {}
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
