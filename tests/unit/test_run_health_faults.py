"""Planted faults of issue #23 in the real loop (tiny K3, in process): a dropped chunk and a stale chunk fail the
sync naming chunk and version, and the harness's ``adapter_delivered`` criterion fails the same way from the run
directory; an engine that keeps the previous adapter (reporting the new version) is caught by the on-policy
bands. The healthy run carries replica digests, delivery digests and the token KL, and they PASS."""

import json

import pytest
from tiny_checkpoint import write_tiny_run_inputs

from harness.criteria import Status, evaluate
from harness.readers import read_run
from harness.tier import load_tier
from k3.launch.train import main as train_main
from k3.rollout.embedded.sync_faults import SYNC_FAULT_ENV, SyncFault, parse_sync_fault

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("health"))


def _argv(root, run):
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", "3",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "6", "--eval-interval", "3", "--lr", "1e-2", "--save-interval", "3",
            "--reward-model", "deterministic_random",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run)]


def _judge(run, criterion_id):
    tier = load_tier("smoke")
    c = next(c for c in tier.criteria if c.id == criterion_id)
    return evaluate(c, read_run(run, finished=True))


def _events(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(setup, monkeypatch, name, fault=None):
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    if fault:
        monkeypatch.setenv(SYNC_FAULT_ENV, fault)
    run = setup / name
    return train_main(_argv(setup, run)), run


def test_a_healthy_run_carries_the_health_events_and_passes_them(setup, monkeypatch, capsys):
    code, run = _run(setup, monkeypatch, "healthy")
    assert code == 0
    ev = _events(run)
    syncs = [e for e in ev if e["event"] == "sync"]
    assert all(s["adapter/engine_version"] == s["adapter/version"] for s in syncs)
    assert all(len(s["chunk_digests"]) == s["adapter/chunks"] for s in syncs)
    replicas = [e for e in ev if e["event"] == "replicas"]
    assert [r["step"] for r in replicas] == [1, 2, 3] and all(r["rank"] == 0 and r["digests"] for r in replicas)
    train = [e for e in ev if e["event"] == "train"]
    with capsys.disabled():
        print("\nhealthy: abs diff", [t["rollout/train_rollout_logprob_abs_diff"] for t in train],
              "KL", [t["rollout/train_rollout_kl"] for t in train])
    assert all(0 <= t["rollout/train_rollout_kl"] < 1e-5 for t in train)
    for cid in ("replicas_agree", "adapter_delivered", "adapter_version_advances", "on_policy_logprob_diff",
                "on_policy_kl"):
        result = _judge(run, cid)
        assert result.status is Status.PASS, (cid, result.summary)


@pytest.mark.parametrize("fault, message", [
    ("drop_chunk:3", "chunk 3 of version 2 is missing at the engine"),
    ("stale_chunk:1", "chunk 1 of version 2 differs at the engine"),
])
def test_a_dropped_or_stale_chunk_fails_the_sync_and_the_criterion(setup, monkeypatch, fault, message):
    code, run = _run(setup, monkeypatch, fault.replace(":", "_"), fault)
    assert code == 1
    ev = _events(run)
    assert ev[-1]["status"] == "failed" and message in ev[-1]["error"] and "adapter sync 1" in ev[-1]["error"]
    result = _judge(run, "adapter_delivered")
    chunk = fault.split(":")[1]
    assert result.status is Status.FAIL and f"chunk {chunk} of version 2" in result.summary, result.summary
    assert result.evidence["first_failing_sync"] == 1 and result.evidence["chunk"] == int(chunk)


def test_an_engine_that_keeps_the_previous_adapter_is_off_policy(setup, monkeypatch, capsys):
    code, run = _run(setup, monkeypatch, "keep", "keep_adapter")
    assert code == 0  # it lies about what it serves: only the log-probs give it away
    train = [e for e in _events(run) if e["event"] == "train"]
    with capsys.disabled():
        print("\nkeep_adapter: abs diff", [t["rollout/train_rollout_logprob_abs_diff"] for t in train],
              "KL", [t["rollout/train_rollout_kl"] for t in train])
    for cid in ("on_policy_logprob_diff", "on_policy_kl"):
        result = _judge(run, cid)
        assert result.status is Status.FAIL and "@1" in result.summary, (cid, result.summary)
    assert _judge(run, "adapter_delivered").status is Status.PASS  # the digests it reports are what it received


def test_sync_fault_hook_parses_and_refuses_bad_values():
    assert parse_sync_fault("drop_chunk:3") == SyncFault("drop_chunk", 3)
    assert parse_sync_fault("keep_adapter") == SyncFault("keep_adapter")
    for bad in ("drop_chunk", "stale_chunk:x", "keep_adapter:1", "explode"):
        with pytest.raises(ValueError, match=SYNC_FAULT_ENV):
            parse_sync_fault(bad)
