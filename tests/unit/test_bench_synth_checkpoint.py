"""bench/synth_checkpoint.py's disk anchor: it writes the bytes it reports (whole 64 MiB blocks), flushes them, and
leaves nothing behind; a disk run after a writer run takes that run's size."""

import pytest

from bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("synth_checkpoint")


def test_disk_probe_writes_whole_blocks_and_removes_its_file(bench, tmp_path, monkeypatch):
    sizes = []
    real_fsync = bench.os.fsync

    def fsync(fd):
        sizes.append(bench.os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(bench.os, "fsync", fsync)
    row = bench.disk_once(bench.DISK_BLOCK + 1, 2, tmp_path / "probe")
    assert row["bytes"] == 2 * bench.DISK_BLOCK == sizes[0]
    assert row["device"] == "disk" and row["workers"] == 2 and row["cpu_s"] is None
    assert row["gb_per_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_disk_run_takes_the_size_of_the_run_before_it(bench, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(bench, "run_once", lambda args, w, device, out: {
        "workers": w, "device": device, "seconds": 1.0, "bytes": 3 << 20, "gb_per_s": 0.003, "cpu_s": 1.0,
        "gb_per_cpu_s": 0.003, "sha256": {"a": "x"}})
    monkeypatch.setattr(bench, "disk_once", lambda total, threads, out: asked.append((total, threads)) or {
        "workers": threads, "device": "disk", "seconds": 1.0, "bytes": total, "gb_per_s": 0.1, "cpu_s": None,
        "gb_per_cpu_s": None})
    result = bench.main(["--runs", "cpu:1,disk:3", "--work-dir", str(tmp_path)])
    assert asked == [(3 << 20, 3)]
    assert result["same_bytes"] is True and [r["device"] for r in result["runs"]] == ["cpu", "disk"]
