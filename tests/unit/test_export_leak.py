"""The CI leak gate: 50+ export + hand-off cycles between two real processes, after each of which the
producer's memory is back at its baseline — and planted leaks that prove the gate fails and names the first
sync where memory did not return.

The producer is this test process (a trainer rank stand-in: a tiny K3 with rank-64 adapters, ~1.5 MB and 26
chunks per sync); the receiver is a spawned engine process that loads every complete version into its own
tiny K3 by PEFT name. On CPU the buckets travel as ``/dev/shm/torch_<pid>_*`` segments (``file_system``
strategy, so a segment left behind is visible); on CUDA as IPC handles (marked ``gpu``).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.multiprocessing as mp

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.export import export_chunks, load_adapter_tensors
from k3.model import KimiK3ForCausalLM
from k3.transport.handoff import (AdapterProducer, AdapterReceiver, HandoffTimeout, TransferBuffer,
                                  digest_tensors, spawn_receiver)
from k3.transport.leakcheck import LeakCheck, LeakError

RANK = 64
SYNCS = 50

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True, scope="module")
def _restore_sharing_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


def _tiny_lora(device: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=RANK, alpha=2 * RANK)).to(device)


class _HungReceiver(AdapterReceiver):
    """An engine that stops answering (and keeps the bucket it is reading) from version ``hang_from`` on."""

    def __init__(self, hang_from: int, **kw) -> None:
        super().__init__(**kw)
        self.hang_from = hang_from

    def receive(self, header, bucket):
        if header.version >= self.hang_from:
            time.sleep(3600)
        return super().receive(header, bucket)


def _engine_receiver(device: str, hang_from: int | None = None) -> AdapterReceiver:
    """Runs in the engine process: a tiny K3 that loads each complete version by PEFT name."""
    engine = _tiny_lora(device, seed=1)
    expected = {n: tuple(t.shape) for c in export_chunks(engine, 0) for n, t in c.tensors}

    def load(version, tensors, config):
        load_adapter_tensors(engine, tensors.items(), strict=True)

    kw = dict(expected=expected, on_activate=load, device=device)
    return AdapterReceiver(**kw) if hang_from is None else _HungReceiver(hang_from, **kw)


class _Trainer:
    """The producer side: a 'training step' changes the adapters, then a sync exports and hands them off."""

    def __init__(self, device: str, conn, gate: LeakCheck, buffered: bool = False, ack_timeout_s: float = 60):
        self.model = _tiny_lora(device)
        self.gate = gate
        self.buffer = TransferBuffer(device, torch.bfloat16) if buffered else None
        self.producer = AdapterProducer(conn, transfer_buffer=self.buffer, ack_timeout_s=ack_timeout_s,
                                        on_bucket=gate.track)
        self.version = 0
        self.records: list[dict] = []

    @torch.no_grad()
    def step(self) -> None:
        for n, p in self.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.01)

    def sync(self, keep: list | None = None):
        self.version += 1
        self.records.append(self.gate.memory_record("before_update_weights", rollout_id=self.version))

        def tracked():
            for chunk in export_chunks(self.model, self.version):
                self.gate.track(chunk)
                if keep is not None:
                    keep.append(chunk)  # the planted leak: a list that keeps every chunk
                yield chunk

        try:
            return self.producer.send_version(tracked())
        finally:
            self.records.append(self.gate.memory_record("after_update_weights", rollout_id=self.version))


WARMUP_SYNCS = 2  # the first syncs create what stays on purpose (connection, shm manager, buffer, code paths)


def _run(device, syncs, buffered=False, keep_from=None, hang_from=None, ack_timeout_s=30.0):
    gate = LeakCheck(device=device)
    proc, conn = spawn_receiver(functools.partial(_engine_receiver, device, hang_from))
    kept: list = []
    timeouts: list[int] = []
    try:
        trainer = _Trainer(device, conn, gate, buffered=buffered)  # patient while the engine starts
        for i in range(-WARMUP_SYNCS, syncs):
            if i == 0:
                gate.set_baseline()
                trainer.producer.ack_timeout_s = ack_timeout_s
            trainer.step()
            try:
                ack = trainer.sync(keep=kept if keep_from is not None and i >= keep_from else None)
            except HandoffTimeout:
                timeouts.append(i)
            else:  # the engine activated exactly this version, bit for bit
                want = digest_tensors([kv for c in export_chunks(trainer.model, ack.version) for kv in c.tensors])
                assert ack.active_version == trainer.version and ack.digest == want
            if i >= 0:
                gate.end_sync()
        if hang_from is None:
            trainer.producer.close()
            proc.join(timeout=30)
            assert proc.exitcode == 0
        return gate.report(), trainer, timeouts
    finally:
        if proc.is_alive():
            proc.kill()  # the hung engine of the planted leak
            proc.join()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buffered", [False, True], ids=["fresh-buckets", "transfer-buffer"])
def test_memory_returns_to_baseline_after_every_sync(device, buffered):
    report, trainer, timeouts = _run(device, SYNCS, buffered=buffered)
    assert not timeouts
    assert report.syncs == SYNCS
    assert report.ok, str(report)
    assert report.first_bad_sync is None
    assert abs(report.rss_slope_bytes_per_sync) < 256 * 1024
    # what the trainer logs around every sync (metrics.jsonl memory events)
    assert len(trainer.records) == 2 * (SYNCS + WARMUP_SYNCS)
    assert {r["phase"] for r in trainer.records} == {"before_update_weights", "after_update_weights"}
    assert all(r["event"] == "memory" and r["memory/allocated_gb"] > 0 for r in trainer.records)
    if device == "cuda":
        base = trainer.gate.baseline.cuda_allocated_bytes
        assert all(abs(s.cuda_allocated_bytes - base) <= 1 << 20 for s in trainer.gate.samples)


@pytest.mark.parametrize("device", DEVICES)
def test_a_list_that_keeps_each_chunk_fails_the_gate_at_its_first_sync(device):
    report, trainer, _ = _run(device, syncs=12, keep_from=5)
    assert not report.ok and report.first_bad_sync == 5
    first = [msg for i, msg in report.problems if i == 5]
    per_sync = sum(len(c.tensors) for c in export_chunks(trainer.model, 0))  # 132 tensors in 26 chunks
    assert any(f"exported storages still alive ({per_sync} from sync 5)" in m for m in first), str(report)
    if device == "cpu":  # ~1.5 MB kept per sync: the RSS trend names the same sync
        assert any(m.startswith("RSS grows") for m in first), str(report)
    else:
        assert any(m.startswith("CUDA allocated") for m in first), str(report)
    assert all(i >= 5 for i, _ in report.problems)
    with pytest.raises(LeakError, match="first at sync 5"):
        trainer.gate.check()


def test_a_receiver_that_never_acks_fails_the_gate_at_its_first_sync():
    report, trainer, timeouts = _run("cpu", syncs=7, hang_from=6, ack_timeout_s=0.3)
    # versions: warm-up 1-2, syncs 0..6 send versions 3..9; the engine hangs from version 6 = sync 3
    assert timeouts == [3, 4, 5, 6]
    assert not report.ok and report.first_bad_sync == 3, str(report)
    at3 = " ".join(msg for i, msg in report.problems if i == 3)
    assert "exported storages still alive" in at3 and "shared-memory segments not in the baseline" in at3
    assert len(trainer.producer.unacked) == 4  # one held bucket per unanswered sync: held, never freed early
