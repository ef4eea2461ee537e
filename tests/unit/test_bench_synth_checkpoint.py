"""bench/synth_checkpoint.py's disk anchor: it writes the bytes it reports (whole 64 MiB blocks), flushes them, and
leaves nothing behind; a disk run after a writer run takes that run's size. A writer run splits its wall time into
the phases the command reports."""

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


def test_a_writer_run_reads_the_command_s_phases(bench, tmp_path):
    """The real command on the tiny model: its closing line's phases come back in the row, and the start-up is the
    wall time the phases leave."""
    import argparse

    args = argparse.Namespace(variant="tiny", format="bf16", seed=0, num_experts=None, num_layers=None,
                              check_bytes=False)
    row = bench.run_once(args, 1, "cpu", tmp_path / "ckpt")
    assert {"startup_s", "write_s", "write_gb_per_s", "fsync_s"} <= set(row)
    assert row["startup_s"] > 0 and row["write_s"] >= 0 and row["fsync_s"] >= 0
    assert row["startup_s"] + row["write_s"] + row["fsync_s"] <= row["seconds"] + 0.2  # printed to 0.1 s
    assert not (tmp_path / "ckpt").exists()


def test_phases_parse_from_the_line_and_are_absent_without_it(bench):
    line = "wrote bf16 4layer checkpoint to /x in 14.8 s (12.00 GB: files 0.1 s, generate + write 10.0 s " \
           "(1.20 GB/s), fsync 4.4 s)\n"
    assert bench.command_phases(line, 15.0) == {"startup_s": 0.5, "write_s": 10.0, "write_gb_per_s": 1.2,
                                                "fsync_s": 4.4}
    assert bench.command_phases("wrote it in 3 s\n", 3.0) == {}
    assert bench.phases_text({}) == ""
    assert bench.phases_text({"startup_s": 0.5, "write_s": 10.0, "write_gb_per_s": 1.2, "fsync_s": 4.4}) == (
        " (start-up 0.5 s, write 10.0 s = 1.20 GB/s, fsync 4.4 s)")
