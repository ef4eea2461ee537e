"""Resumed runs (issue #24 item 2, the harness side): a run killed (kill -9: no status) at several points and
resumed with --resume is judged on every sync of every attempt. The later attempt's values of the rollouts it
ran again win, and the harness says so; sync numbers and adapter versions continue across the resume (the
resumed startup sync delivers the saved version + 1); each attempt's memory baseline is set by the same rule
as at the start. A later attempt that leaks, or a version that does not continue, fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.criteria import Status, evaluate_all  # noqa: E402
from harness.monitor import Watcher  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.tier import load_tier  # noqa: E402
from harness.verdict import EXIT_PASS  # noqa: E402


def write(tmp_path: Path, events: list[dict], s: H.Scenario = H.AT_SCALE) -> Path:
    return H.write_run_dir(tmp_path / "run", s, lines=[json.dumps(e) for e in events])


def criteria(tier: str = "full", profile: str | None = "gb300") -> list:
    """The tier's criteria, plus the adapter-version one of the smaller tiers when it has none (full)."""
    chosen = load_tier(tier).active(profile)
    if not any(c.id == "adapter_version_advances" for c in chosen):
        chosen += [c for c in load_tier("4layer").criteria if c.id == "adapter_version_advances"]
    return chosen


def judge(path: Path, tier: str = "full", profile: str | None = "gb300"):
    run = read_run(path)
    return run, {r.id: r for r in evaluate_all(criteria(tier, profile), run)}


def _base(rank: int) -> float:
    return 90.94 + 0.01 * (rank % 3)


@pytest.mark.parametrize("kill, at, checkpoint", [("rollout", 6, 4), ("train", 6, 4), ("sync", 6, 4), ("save", 6, 4),
                                                  ("train", 12, 9)])
def test_a_killed_and_resumed_healthy_run_passes_on_every_sync(tmp_path, kill, at, checkpoint):
    events = H.resumed_events(H.AT_SCALE, kill=kill, at=at, checkpoint=checkpoint)
    run, results = judge(write(tmp_path, events))
    assert run.problems == []
    assert {k: (str(r.status), r.summary) for k, r in results.items() if r.status is not Status.PASS} == {}
    # Every sync of both attempts judged: nothing skipped as "logged again".
    syncs = sorted({e["sync"] for e in events if e["event"] == "memory"})
    memory = run.memory_series("after_update_weights", "memory/allocated_gb")
    assert all(sorted(by_sync) == syncs or (kill == "sync" and sorted(by_sync) == [s for s in syncs if s != at + 1])
               for by_sync in memory.values())
    resumed_startup = next(e["sync"] for e in events if e["event"] == "sync" and e["rollout_id"] is None
                           and e["sync"] > 0)
    r = results["memory_returns_to_baseline"]
    assert r.evidence["startup_syncs"] == [0, resumed_startup] and r.evidence["attempts"] == 2
    assert "startup syncs 0, " in r.summary
    # No rollout lost or counted twice: 0–19 once each, those from the checkpoint on from attempt 2.
    reward = run.series("rollout/raw_reward")
    assert sorted(reward) == list(range(20))
    assert {i for i, p in reward.items() if p.attempt == 1} == set(range(checkpoint + 1, 20))
    versions = results["adapter_version_advances"]
    assert f"(the resume at rollout {checkpoint + 1}: saved version {checkpoint + 2} + 1)" in versions.summary
    second = next(i for i, e in enumerate(events) if e.get("status") == "started" and i > 0)
    rerun = [e["rollout_id"] for e in events[:second] if e["event"] == "rollout" and e["rollout_id"] > checkpoint]
    note = run.notes()
    assert len(note) == 1 and note[0].startswith(
        f"attempt 2 (metrics.jsonl:{second + 1}) resumed from adapters/rollout_{checkpoint:06d} at rollout "
        f"{checkpoint + 1} after attempt 1 ended without a finished or failed status (killed)")
    if rerun:
        assert f"rollouts {checkpoint + 1}" in note[0]
        assert "superseded by attempt 2's (the later attempt wins)" in note[0]


def test_each_attempt_has_its_own_baseline(tmp_path):
    """The resumed process settles 0.8 GB higher: against attempt 1's baseline every later sync would fail."""
    _, results = judge(write(tmp_path, H.resumed_events(H.AT_SCALE, level_shift_gb=0.8)))
    r = results["memory_returns_to_baseline"]
    assert r.status is Status.PASS and r.evidence["baseline_gb_max"] == pytest.approx(90.96 + 0.8)
    assert results["memory_no_growth"].status is Status.PASS


def test_a_resume_whose_later_attempt_leaks_fails(tmp_path):
    def later(rank: int, sync: int) -> float:  # attempt 2: syncs 7 (startup), 8 (baseline), …; rank 9 leaks from 13
        return _base(rank) + 1.2 + (0.3 * (sync - 12) if rank == 9 and sync >= 13 else 0.0)

    _, results = judge(write(tmp_path, H.resumed_events(H.AT_SCALE, later_memory=later)))
    r = results["memory_returns_to_baseline"]
    assert (r.status, r.evidence["first_failing_rank"], r.evidence["first_failing_sync"]) == (Status.FAIL, 9, 14)
    assert r.summary.startswith("rank 9 after sync 14: 92.74 GB vs baseline 92.14 GB (+0.60 GB")
    assert results["memory_no_growth"].status is Status.FAIL
    assert results["memory_no_growth"].evidence["growing_ranks"] == [9]


def test_a_leak_in_the_killed_attempt_still_fails(tmp_path):
    def memory(rank: int, sync: int) -> float:
        return _base(rank) + (0.7 if rank == 3 and sync == 4 else 0.0)

    _, results = judge(write(tmp_path, H.resumed_events(H.AT_SCALE.but(memory=memory))))
    r = results["memory_returns_to_baseline"]
    assert (r.status, r.evidence["first_failing_rank"], r.evidence["first_failing_sync"]) == (Status.FAIL, 3, 4)


def _restart_numbering(events: list[dict]) -> list[dict]:
    """What `k3 train --resume` wrote before the contract: sync from 0 and adapter version from 1 again."""
    resumed = events.index(next(e for e in events if e.get("status") == "resumed"))
    first = next(e["sync"] for e in events[resumed:] if "sync" in e)
    out = []
    for i, e in enumerate(events):
        if i > resumed and "sync" in e:
            e = {**e, "sync": e["sync"] - first}
            if "adapter/version" in e:
                e["adapter/version"] = e["sync"] + 1
        out.append(e)
    return out


def test_a_resume_that_restarts_sync_numbers_is_read_on_and_its_version_fails(tmp_path):
    run, results = judge(write(tmp_path, _restart_numbering(H.resumed_events(H.AT_SCALE))))
    assert run.problems == []
    assert "; it numbered its syncs from 0 again, read as syncs 7… (sync numbers continue across a resume" in \
        run.notes()[0]
    # The later readings are judged, not skipped as "logged again".
    assert results["memory_returns_to_baseline"].status is Status.PASS
    assert results["memory_returns_to_baseline"].evidence["syncs"] == 6 + 15  # after rollouts 0–5, then 5–19
    r = results["adapter_version_advances"]
    assert r.status is Status.FAIL
    assert r.summary == "sync 7: version 1, expected 7 (the resume at rollout 5: saved version 6 + 1)"


@pytest.mark.parametrize("delivered, expected_text", [
    (6, "sync 7: version 6, expected 7"),  # the saved version again: the engine was not told of a new one
    (9, "sync 7: version 9, expected 7"),
])
def test_a_resumed_version_that_does_not_continue_from_the_checkpoint_fails(tmp_path, delivered, expected_text):
    events = H.resumed_events(H.AT_SCALE)
    startup = next(e for e in events if e["event"] == "sync" and e["sync"] == 7)
    startup["adapter/version"] = delivered
    _, results = judge(write(tmp_path, events))
    r = results["adapter_version_advances"]
    assert r.status is Status.FAIL and r.summary.startswith(expected_text)


def test_a_version_jump_inside_the_resumed_attempt_fails(tmp_path):
    events = H.resumed_events(H.AT_SCALE)
    later = next(e for e in events if e["event"] == "sync" and e["sync"] == 10)
    later["adapter/version"] += 1
    _, results = judge(write(tmp_path, events))
    assert results["adapter_version_advances"].summary == "sync 10: version 11 after 9 (expected +1)"


def test_a_finished_run_extended_with_resume(tmp_path):
    s = H.AT_SCALE.but(ranks=4)
    first = H.events(s)
    more = H._attempt_events(s.but(rollouts=25), first[-1]["time"] + 60, first_rollout=20, first_sync=21,
                             first_version=22, resumed_from="adapters/rollout_000019")
    path = write(tmp_path, first + more, s)
    run, results = judge(path)
    assert run.finished and run.problems == []
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
    assert sorted(run.series("rollout/raw_reward")) == list(range(25))
    assert run.notes()[0].startswith("attempt 2 (metrics.jsonl:") and "after attempt 1 finished" in run.notes()[0]
    # While the extension runs, the run is running again (absent data PENDING, not MISSING).
    middle = read_run(H.write_run_dir(tmp_path / "middle", s, lines=[json.dumps(e) for e in first + more[:30]]))
    assert not middle.finished


def test_a_restart_without_a_checkpoint_replaces_every_rollout(tmp_path):
    """`--resume` before the first save started over at rollout 0 (no resumed event): its values win."""
    s = H.AT_SCALE.but(ranks=2, rollouts=12)
    first = H.events(s.but(finished=False))[:60]
    again = H._attempt_events(s.but(reward=lambda n: 0.7), first[-1]["time"] + 60, first_sync=first[-1]["sync"] + 1)
    run, results = judge(write(tmp_path, first + again, s), profile=None)
    assert {p.value for p in run.series("rollout/raw_reward").values()} == {0.7}
    assert "started over from rollout 0 (no resumed event)" in run.notes()[0]
    assert "rollouts 0–" in run.notes()[0]
    assert results["adapter_version_advances"].status is Status.PASS  # a fresh start delivers version 1 again


def test_completes_counts_the_attempts_not_the_downtime(tmp_path):
    config = {"model_variant": "tiny", "expert_model_parallel_size": 1, "lora_base_cpu_backup": True,
              "colocate_memory_peak_device": "gpu"}
    s = H.HEALTHY.but(ranks=1, rollouts=10, cycle_seconds=lambda n: 20.0, config=config, aime_solved={0: 3, 9: 9},
                      startup_seconds=15.0, eval_seconds=5.0, startup_offset_gb=0.05)
    events = H.resumed_events(s, kill="train", at=6, checkpoint=4, downtime_s=3 * 3600.0, level_shift_gb=0.0)
    _, results = judge(write(tmp_path, events, s), tier="smoke", profile=None)
    assert {k: str(r.status) for k, r in results.items() if r.status is not Status.PASS} == {}
    r = results["completes"]
    assert r.evidence["minutes"] < 5 and r.summary.endswith("10 rollouts over 2 attempts")


def test_an_earlier_attempt_that_failed_is_named(tmp_path):
    s = H.AT_SCALE.but(ranks=2)
    events = H.resumed_events(s, kill="train", at=6, checkpoint=4)
    resumed = events.index(next(e for e in events if e.get("status") == "started" and e["time"] > H.T0))
    events.insert(resumed, {"time": events[resumed - 1]["time"] + 1, "event": "status", "rollout_id": None,
                            "status": "failed", "error": "RuntimeError: NCCL timeout"})
    run, results = judge(write(tmp_path, events, s), profile=None)
    assert results["adapter_version_advances"].status is Status.PASS
    assert "after attempt 1 failed" in run.notes()[0]


def test_a_resumed_run_never_hard_fails_on_the_way(tmp_path):
    """Judged after every event as the watch does: the resume, the new startup sync below the level, the new
    attempt's level: no hard FAIL anywhere, and the watch of the whole run passes."""
    s = H.AT_SCALE.but(ranks=2, rollouts=12)
    path = write(tmp_path, H.resumed_events(s, kill="sync", at=6, checkpoint=4), s)
    run = read_run(path)
    chosen = criteria()
    for seq in range(run.events):
        bad = [r for r in evaluate_all(chosen, run.until(seq)) if r.hard_fail]
        assert not bad, (seq, run.where_of(seq), [(r.id, r.summary) for r in bad])
    outcome = Watcher(path, chosen, poll_s=0.01, timeout_s=10).run()
    assert outcome.exit_code == EXIT_PASS, [(r.id, r.summary) for r in outcome.results]


def test_a_resumed_status_without_its_rollout_is_reported(tmp_path):
    events = H.resumed_events(H.AT_SCALE.but(ranks=2))
    resumed = next(e for e in events if e.get("status") == "resumed")
    del resumed["next_rollout"]
    run, results = judge(write(tmp_path, events, H.AT_SCALE.but(ranks=2)), profile=None)
    assert any("a resumed status needs a non-negative integer 'next_rollout'" in str(p) for p in run.problems)
    r = results["adapter_version_advances"]
    assert r.status is Status.MISSING and "attempt 2 resumed at an unlogged rollout" in r.summary
