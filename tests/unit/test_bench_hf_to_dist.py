"""bench/hf_to_dist.py: it times `cp` and `k3 convert hf-to-dist` per writer count on one source, reads the
command's own time back, and leaves nothing behind."""

import json

import pytest

from bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("hf_to_dist")


def test_the_command_s_own_time_is_read_from_its_line(bench):
    assert bench.convert_seconds("noise\nwrote /x/dcp/release (TP=1, EP=1, PP=1) in 18.5 s\n") == 18.5
    assert bench.convert_seconds("wrote /x (TP=2, EP=1, PP=1) in 3 s") is None  # not a one-process run
    assert bench.convert_seconds("") is None


def test_a_tiny_run_times_cp_and_each_writer_count(bench, tmp_path):
    out = tmp_path / "r.json"
    result = bench.main(["--variant", "tiny", "--num-layers", "2", "--writers", "3", "--work-dir",
                         str(tmp_path / "w"), "--out", str(out)])
    runs = result["runs"]
    assert [r["run"] for r in runs] == ["cp -r SRC && sync", "hf-to-dist --save-writers 3"]
    assert [r["writers"] for r in runs] == [None, 3]
    assert runs[0]["convert_s"] is None and 0 < runs[1]["convert_s"] <= runs[1]["seconds"]
    assert runs[0]["bytes"] > 0 and runs[1]["bytes"] > runs[0]["bytes"] / 2  # torch_dist holds the same tensors
    assert all(r["gb_per_s"] > 0 for r in runs)
    assert json.loads(out.read_text()) == result
    assert list((tmp_path / "w").iterdir()) == []  # the source and the output are removed


def test_a_writer_count_below_one_is_refused(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--writers", "2,0", "--work-dir", str(tmp_path)])
    assert "--writers 2,0: every value must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
