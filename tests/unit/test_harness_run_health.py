"""The run-health criteria of issue #23 on fixture runs (tests/fixtures/harness_runs.py): healthy runs PASS;
each planted fault FAILs naming what broke — the replica's tensor, ranks and step; the sync, version and chunk
the engine lacks or holds stale; the sync whose engine kept an old version; the off-policy rollout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import harness_runs as H  # noqa: E402

from harness.criteria import Status, evaluate  # noqa: E402
from harness.readers import read_run  # noqa: E402
from harness.tier import load_tier  # noqa: E402

IDS = ("replicas_agree", "adapter_delivered", "adapter_version_advances", "on_policy_logprob_diff", "on_policy_kl")
SMALL = H.HEALTHY.but(ranks=4, rollouts=6, eval_interval=3, aime_solved={0: 11, 2: 13, 5: 14})


def _judge(tmp_path: Path, s: H.Scenario, cid: str, tier: str = "4layer"):
    run = H.write_run_dir(tmp_path / "run", s)
    c = next(c for c in load_tier(tier).criteria if c.id == cid)
    return evaluate(c, read_run(run))


@pytest.mark.parametrize("tier", ["smoke", "4layer"])
@pytest.mark.parametrize("cid", IDS)
def test_healthy_runs_pass(tmp_path, tier, cid):
    result = _judge(tmp_path, SMALL, cid, tier)
    assert result.status is Status.PASS, result.summary


def test_a_drifted_replica_fails_at_its_first_step_naming_tensor_and_ranks(tmp_path):
    label = H.REPLICA_LABELS[0]

    def drift(step, rank, lab):
        good = H._replica_digest(step, rank, lab)
        return good[:-1] + "c" if (lab == label and rank == 2 and step >= 3) else good

    result = _judge(tmp_path, SMALL.but(replica_digest=drift), "replicas_agree")
    assert result.status is Status.FAIL and result.final
    assert result.summary == f"step 3: replicas of {label} differ: ranks 0,1,3 vs rank 2"
    assert result.evidence["rank_groups"] == [[0, 1, 3], [2]] and result.evidence["first_failing_step"] == 3


def test_a_dropped_chunk_fails_naming_sync_version_and_chunk(tmp_path):
    dropped = SMALL.but(engine_chunk=lambda v, k: "" if (v == 4 and k == 7) else H._trained_digest(v, k))
    result = _judge(tmp_path, dropped, "adapter_delivered")
    assert result.status is Status.FAIL
    assert result.summary.startswith("sync 3: chunk 7 of version 4 missing at engine 0"), result.summary


def test_a_stale_chunk_from_the_previous_version_fails(tmp_path):
    stale = SMALL.but(engine_chunk=lambda v, k: H._trained_digest(v - 1 if (v == 5 and k == 2) else v, k))
    result = _judge(tmp_path, stale, "adapter_delivered")
    assert result.status is Status.FAIL and result.evidence["problem"] == "differs"
    assert result.summary.startswith("sync 4: chunk 2 of version 5 differs at engine 0"), result.summary


def test_an_engine_that_kept_an_old_version_fails_advances(tmp_path):
    stuck = SMALL.but(engine_version=lambda v: min(v, 3))
    result = _judge(tmp_path, stuck, "adapter_version_advances")
    assert result.status is Status.FAIL
    assert result.summary == "sync 3: the engine reports version 3 active, version 4 was sent"
    assert _judge(tmp_path / "d", stuck, "adapter_delivered").summary.startswith(
        "sync 3: engine 0 reports version 3 active, version 4 was sent")


def test_an_off_policy_rollout_fails_the_bands_naming_it(tmp_path):
    off = SMALL.but(on_policy=lambda n: (0.15, 0.017) if n >= 4 else (2e-4, 2e-6))
    for cid in ("on_policy_logprob_diff", "on_policy_kl"):
        result = _judge(tmp_path / cid, off, cid, "smoke")
        assert result.status is Status.FAIL and result.evidence["failing_index"] == 4, result.summary


def test_runs_without_the_events_are_missing_not_passed(tmp_path):
    bare = SMALL.but(with_health=False)
    for cid in ("replicas_agree", "adapter_delivered", "on_policy_kl"):
        assert _judge(tmp_path / cid, bare, cid).status is Status.MISSING
    # without an engine-reported version the sent one is judged, as before
    assert _judge(tmp_path / "adv", bare, "adapter_version_advances").status is Status.PASS


@pytest.mark.parametrize("bad, message", [
    ({"rank": 0, "step": -1, "digests": {}}, "non-negative integer 'step'"),
    ({"rank": "0", "step": 1, "digests": {}}, "non-negative integer 'rank'"),
    ({"rank": 0, "step": 1, "digests": {"a": 3}}, "'digests': an object of tensor label -> digest string"),
])
def test_a_malformed_replicas_event_is_reported_with_its_line(tmp_path, bad, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"time": 1.0, "event": "replicas", "rollout_id": 0, **bad}) + "\n")
    data = read_run(run, finished=True)
    assert any(p.where == "metrics.jsonl:1" and message in p.message for p in data.problems), data.problems
    assert not data.replicas


def test_malformed_delivery_digests_are_reported_and_ignored(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"time": 1.0, "event": "sync", "rollout_id": None, "sync": 0, "adapter/version": 1, "chunk_digests": [1],
         "engine_chunk_digests": [{"engine": 0, "chunks": {"x": "d"}}]}) + "\n")
    data = read_run(run, finished=True)
    assert [p.message.split(" ")[0] for p in data.problems] == ["'chunk_digests'", "'engine_chunk_digests'"]
    assert data.syncs[0].trained_digests is None and data.syncs[0].engine_digests == ()


def test_the_new_kinds_refuse_a_negative_minimum():
    from harness.criteria import SpecError, build_criterion

    for kind, field in (("replicas_agree", "min_steps"), ("delivered", "min_syncs")):
        with pytest.raises(SpecError, match=f"'{field}' must not be negative"):
            build_criterion({"id": "x", "kind": kind, "metric": "m", "doc": "d", field: -1}, "t.toml", set())
