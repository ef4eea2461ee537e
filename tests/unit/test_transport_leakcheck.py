"""LeakCheck, the reusable gate: each check on its own, the RSS trend maths, the error, the metrics record."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from k3.transport.leakcheck import LeakCheck, LeakError, least_squares_slope

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _restore_sharing_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


class _FakeRSS:
    """Stands in for psutil.Process: returns the given RSS values one sample at a time."""

    def __init__(self, values):
        self.values = list(values)

    def memory_info(self):
        return SimpleNamespace(rss=self.values.pop(0))


def _gate_with_rss(base, values, **kw):
    gate = LeakCheck(**kw)
    gate._process = _FakeRSS([base, *values])
    gate.set_baseline()
    for _ in values:
        gate.end_sync()
    return gate


def test_least_squares_slope_closed_form():
    assert least_squares_slope([0, 2, 4, 6]) == 2.0
    assert least_squares_slope([5, 5, 5]) == 0.0
    assert least_squares_slope([7]) == 0.0
    assert least_squares_slope([1, 3, 2]) == pytest.approx(0.5)


def test_flat_rss_with_noise_passes():
    base = 500 * MiB
    noise = [base + d for d in (40_000, -20_000, 90_000, 0, 30_000, -50_000, 60_000, 10_000)]
    report = _gate_with_rss(base, noise).check()
    assert report.ok and report.first_bad_sync is None and abs(report.rss_slope_bytes_per_sync) < 20_000


def test_rss_trend_names_the_sync_where_growth_starts():
    base = 500 * MiB
    values = [base + 50_000, base + 80_000, base + 60_000] + [base + 60_000 + k * MiB for k in range(1, 8)]
    report = _gate_with_rss(base, values).report()
    assert not report.ok and report.first_bad_sync == 3
    assert report.problems[0][1].startswith("RSS grows")
    assert report.rss_slope_bytes_per_sync > 256 * 1024


def test_rss_stuck_above_tolerance_without_a_trend():
    base = 500 * MiB
    values = [base] * 5 + [base + 40 * MiB] * 40  # one big allocation at sync 5 that never goes away
    gate = _gate_with_rss(base, values, rss_slope_limit_bytes=float("inf"))
    report = gate.report()
    assert report.first_bad_sync == 5 and "stayed more than 32 MiB above baseline" in report.problems[0][1]
    with pytest.raises(LeakError, match="first at sync 5") as e:
        gate.check()
    assert e.value.report is not None and "sync 5:" in str(e.value)


def test_tracked_storages_must_die_by_the_end_of_their_sync():
    gate = LeakCheck()
    gate.set_baseline()
    keep = torch.zeros(1000)
    view = keep[10:]
    gate.track([("a", keep), ("b", torch.ones(3))])  # the second dies at once: only `keep` is reported
    del keep
    assert gate.end_sync() == ["1 exported storages still alive (1 from sync 0)"]  # alive through the view
    del view
    assert gate.end_sync() == []
    report = gate.report()
    assert report.first_bad_sync == 0 and [i for i, _ in report.problems] == [0]


def test_track_accepts_chunks_tensors_and_pairs():
    gate = LeakCheck()
    gate.set_baseline()
    a, b = torch.zeros(2), torch.zeros(3)
    gate.track(SimpleNamespace(tensors=[("x", a)]))
    gate.track(b)
    gate.track([a, b])
    assert sum(gate.live_tracked().values()) == 4
    with pytest.raises(TypeError, match="cannot find a tensor"):
        gate.track(["not a tensor"])


def test_a_shared_memory_segment_left_behind_is_named():
    mp.set_sharing_strategy("file_system")
    gate = LeakCheck()
    gate.set_baseline()
    t = torch.zeros(4096).share_memory_()
    problems = gate.end_sync()
    assert len(problems) == 1 and problems[0].startswith("1 shared-memory segments not in the baseline: torch_")
    del t
    assert gate.end_sync() == []


def test_why_file_system_sharing_file_descriptor_hides_the_segment():
    """Under torch's default strategy a shared storage leaves no /dev/shm entry to observe."""
    prefix = f"torch_{os.getpid()}_"

    def segments():
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}

    before = segments()
    mp.set_sharing_strategy("file_descriptor")
    hidden = torch.zeros(4096).share_memory_()
    assert hidden.is_shared() and segments() == before
    mp.set_sharing_strategy("file_system")
    visible = torch.zeros(4096).share_memory_()
    assert len(segments() - before) == 1
    del visible, hidden
    assert segments() == before


def test_end_sync_needs_a_baseline():
    with pytest.raises(RuntimeError, match="set_baseline"):
        LeakCheck().end_sync()


def test_memory_record_for_the_metrics_log():
    gate = LeakCheck()
    r = gate.memory_record("after_update_weights", rollout_id=4, rank=0)
    assert r["event"] == "memory" and r["phase"] == "after_update_weights" and r["device"] == "cpu"
    assert r["rollout_id"] == 4 and r["rank"] == 0
    assert r["memory/allocated_gb"] == r["memory/rss_gb"] > 0.01  # CPU: RSS stands in for allocated
    assert isinstance(r["memory/shm_segments"], int)


@pytest.mark.gpu
def test_cuda_allocated_must_return_within_one_mib():
    gate = LeakCheck(device="cuda")
    gate.set_baseline()
    small = torch.zeros(1000, device="cuda")  # 4 KB: inside the tolerance
    assert gate.end_sync() == []
    big = torch.zeros(1 << 20, device="cuda")  # 4 MiB
    assert any(p.startswith("CUDA allocated +4.00 MiB") for p in gate.end_sync())
    del big, small
    assert gate.end_sync() == []
    r = gate.memory_record("before_update_weights")
    assert r["device"].startswith("cuda") and "memory/reserved_gb" in r
