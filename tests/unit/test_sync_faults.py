"""Faults in the adapter sync path, with real processes (CPU, file_system sharing, bounded time): the receiver
killed mid-version, a slow receiver, the producer killed between chunks, a chunk twice or out of order; and the
adapter checkpoints a restart resumes from (a killed save, a corrupted file). In each: a clear error instead of
a hang, no partial version ever active, no ``/dev/shm`` segment left behind."""

from __future__ import annotations

import functools
import gc
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Listener
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from k3.lora.export import AdapterChunk
from k3.rl.errors import TrainingError
from k3.rl.resume import STATE_NAME, latest_checkpoint, load_checkpoint_state
from k3.transport.handoff import (AdapterProducer, AdapterReceiver, HandoffError, HandoffRejected, HandoffTimeout,
                                  TransferBuffer, digest_tensors, flat_views, serve, spawn_receiver)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, scope="module")
def _restore_sharing_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


# A three-chunk adapter: 3 + 2 + 1 tensors, BF16, values that differ per version.
LAYOUT = [[("l0.a.lora_A.weight", (2, 8)), ("l0.a.lora_B.weight", (8, 2)), ("l0.b.lora_A.weight", (2, 8))],
          [("l1.a.lora_A.weight", (2, 8)), ("l1.a.lora_B.weight", (8, 2))],
          [("l2.a.lora_A.weight", (2, 8))]]
EXPECTED = {n: s for chunk in LAYOUT for n, s in chunk}


def _version(v: int) -> list[AdapterChunk]:
    g = torch.Generator().manual_seed(v)
    return [AdapterChunk([(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in names], v, i == 0,
                         i == len(LAYOUT) - 1) for i, names in enumerate(LAYOUT)]


def _version_in_place(v: int, producer: AdapterProducer) -> Iterator[AdapterChunk]:
    """``_version(v)``'s chunks, each written into ``producer.bucket_for`` as the exporter writes them: a generator
    that holds the chunk it made last while suspended, as the exporter does."""
    for chunk in _version(v):
        flat = producer.bucket_for(sum(t.numel() for _, t in chunk.tensors), torch.bfloat16, "cpu")
        views = flat_views(flat, [tuple(t.shape) for _, t in chunk.tensors])
        for view, (_, t) in zip(views, chunk.tensors):
            view.copy_(t)
        yield AdapterChunk(list(zip(chunk.names, views)), v, chunk.is_first, chunk.is_last)


def _digest(v: int) -> str:
    return digest_tensors([kv for c in _version(v) for kv in c.tensors])


def _segments(pid: int | None = None) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid or os.getpid()}_")}


class _FaultyReceiver(AdapterReceiver):
    """Misbehaves on chunk ``at`` of version ``version``: ``kill`` (SIGKILL itself while it holds the bucket)
    or ``delay`` (ack ``delay_s`` late)."""

    def __init__(self, fault: str, version: int, at: int, delay_s: float = 0.0) -> None:
        super().__init__(EXPECTED)
        self.fault, self.version, self.at, self.delay_s = fault, version, at, delay_s

    def receive(self, header, bucket):
        if (header.version, header.index) == (self.version, self.at):
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.delay_s)
        return super().receive(header, bucket)


def _make(fault: str = "none", version: int = 0, at: int = 0, delay_s: float = 0.0) -> AdapterReceiver:
    return _FaultyReceiver(fault, version, at, delay_s)


@pytest.fixture
def spawned():
    procs = []

    def start(**fault):
        proc, conn = spawn_receiver(functools.partial(_make, **fault))
        procs.append(proc)
        return proc, conn

    yield start
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


# ---------------------------------------------------------------------- the receiver (engine) dies
@pytest.mark.parametrize("buffered", [False, True])
@pytest.mark.parametrize("in_place", [False, True], ids=["copied-in", "exported-in-place"])
def test_receiver_killed_mid_version_is_an_error_and_leaves_no_segment(spawned, buffered, in_place):
    """Exported in place, the chunk in flight is views of its bucket and the exporter's generator holds it: the
    failed send drops both, so the dead receiver's segment is still told apart and removed."""
    before = _segments()
    proc, conn = spawned(fault="kill", version=2, at=1)
    buffer = TransferBuffer("cpu", torch.bfloat16) if buffered else None
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=30)
    version = functools.partial(_version_in_place, producer=producer) if in_place else _version
    assert producer.send_version(version(1)).digest == _digest(1)
    start = time.monotonic()
    with pytest.raises(HandoffError, match="chunk 1 of version 2") as failure:  # kept: its frames stay alive, as
        producer.send_version(version(2))                                     # in update_weights' except block
    assert time.monotonic() - start < 10  # the broken connection is seen at once, not after the 30 s timeout
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    # The dead receiver never dropped its reference, so torch's ref-counted segment outlives it ...
    left = _segments() - before
    assert len(left) == 1
    # ... until the producer discards it: then nothing of this sync is left in /dev/shm.
    removed = producer.discard_after_receiver_exit()
    assert {name.lstrip("/") for name in removed} == left
    del failure
    gc.collect()
    assert _segments() == before and not producer.unacked
    with pytest.raises(HandoffError, match="producer is closed"):  # a new receiver needs a new producer
        producer.send_chunk(_version(3)[0], 0)


def test_discard_removes_exactly_the_dead_receivers_segments(spawned):
    before = _segments()
    proc, conn = spawned(fault="kill", version=1, at=2)
    producer = AdapterProducer(conn, ack_timeout_s=30)
    with pytest.raises(HandoffError):
        producer.send_version(_version(1))
    proc.join(timeout=10)
    left = _segments() - before
    kept = torch.zeros(4).share_memory_()  # an unrelated live segment of this process must survive
    removed = producer.discard_after_receiver_exit()
    assert {r.lstrip("/") for r in removed} == left
    assert _segments() - before == {kept.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/")}
    del kept
    gc.collect()
    assert _segments() == before


# ---------------------------------------------------------------------- a slow receiver
def test_slow_receiver_times_out_keeps_the_bucket_until_the_late_ack(spawned):
    before = _segments()
    _, conn = spawned(fault="delay", version=1, at=1, delay_s=0.6)
    producer = AdapterProducer(conn, ack_timeout_s=10)  # the spawned receiver needs a while to start
    chunks = _version(1)
    assert producer.send_chunk(chunks[0], 0).ok
    producer.ack_timeout_s = 0.1
    with pytest.raises(HandoffTimeout, match="no ack for chunk 1 of version 1 within 0.1 s"):
        producer.send_chunk(chunks[1], 1)
    assert list(producer.unacked) == [(1, 1)] and len(_segments() - before) == 1  # held: the receiver reads it
    deadline = time.monotonic() + 10
    while producer.collect() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    assert not producer.unacked and _segments() == before  # released once the late ack came
    producer.ack_timeout_s = 10
    last = producer.send_chunk(chunks[2], 2)
    assert last.ok and last.active_version == 1 and last.digest == _digest(1)  # the version still completes
    producer.close()


def test_slow_receiver_with_a_transfer_buffer_is_never_overwritten_early(spawned):
    _, conn = spawned(fault="delay", version=1, at=1, delay_s=0.6)
    producer = AdapterProducer(conn, transfer_buffer=TransferBuffer("cpu", torch.bfloat16), ack_timeout_s=10)
    chunks = _version(1)
    producer.send_chunk(chunks[0], 0)
    producer.ack_timeout_s = 0.1
    with pytest.raises(HandoffTimeout):
        producer.send_chunk(chunks[1], 1)
    with pytest.raises(HandoffError, match=r"chunks \[\(1, 1\)\] were never acked; the transfer buffer"):
        producer.send_chunk(chunks[2], 2)  # the receiver may still be copying chunk 1 out of the buffer
    deadline = time.monotonic() + 10
    while producer.collect() and time.monotonic() < deadline:
        time.sleep(0.05)
    producer.ack_timeout_s = 10
    assert producer.send_chunk(chunks[2], 2).digest == _digest(1)
    producer.close()


# ---------------------------------------------------------------------- the producer (trainer) dies
def _wait_exit(proc, timeout_s: float) -> None:
    # Not proc.join(): the child's torch_shm_manager inherits the write end of join's sentinel pipe and keeps it
    # open until the manager exits, seconds after the child itself; is_alive() asks waitpid instead.
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _produce_then_die(address: str, authkey: bytes, versions: list[int], die_after_chunks: int) -> None:
    """Child (a trainer): connect like ``TrainerWorker.connect``, send ``versions`` in full, then the first
    ``die_after_chunks`` chunks of the next version, then SIGKILL itself."""
    producer = AdapterProducer(Client(address, family="AF_UNIX", authkey=authkey), ack_timeout_s=30)
    for v in versions:
        producer.send_version(_version(v))
    nxt = _version(max(versions, default=0) + 1)
    for i in range(die_after_chunks):
        producer.send_chunk(nxt[i], i)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_producer(receiver: AdapterReceiver, versions: list[int], die_after_chunks: int, tmp: Path) -> int:
    """Serve ``receiver`` on a Unix socket (as ``EngineWorker.listen``) to one producer child; returns its pid."""
    authkey = os.urandom(16)
    with Listener(str(tmp / "adapter.sock"), family="AF_UNIX", authkey=authkey) as listener:
        proc = mp.get_context("spawn").Process(target=_produce_then_die, daemon=True,
                                               args=(listener.address, authkey, versions, die_after_chunks))
        proc.start()
        conn = listener.accept()
        server = threading.Thread(target=serve, args=(conn, receiver), daemon=True)
        server.start()
        server.join(timeout=30)
        _wait_exit(proc, timeout_s=10)
        assert not server.is_alive(), "the receiver did not notice the producer's death"
        assert proc.exitcode == -signal.SIGKILL
        conn.close()
    return proc.pid


def test_producer_killed_between_chunks_keeps_the_last_complete_version(tmp_path):
    rx = AdapterReceiver(EXPECTED)
    pid = _run_producer(rx, versions=[1], die_after_chunks=2, tmp=tmp_path)
    assert rx.active_version == 1 and digest_tensors(rx.active.items()) == _digest(1)
    # a restarted trainer sends the next version from scratch; the half-built one is replaced, never activated
    pid2 = _run_producer(rx, versions=[2], die_after_chunks=0, tmp=tmp_path)
    assert rx.active_version == 2 and digest_tensors(rx.active.items()) == _digest(2)
    # the dead producers' segments are reaped by their torch_shm_manager once nobody holds them
    deadline = time.monotonic() + 10
    while (_segments(pid) or _segments(pid2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _segments(pid) and not _segments(pid2)


# ---------------------------------------------------------------------- a chunk twice / out of order
@pytest.mark.parametrize("order, match", [
    ([0, 1, 1], "chunk index 1, expected 2"),    # the same chunk again at the same position
    ([0, 1, (0, 2)], "delivered twice"),          # chunk 0's tensors again (not marked first) at position 2
    ([0, 2], "chunk index 2, expected 1"),        # a chunk skipped
    ([1], "no version open"),                     # a version that starts in the middle
])
def test_a_chunk_twice_or_out_of_order_is_rejected_and_the_old_version_stays(spawned, order, match):
    before = _segments()
    _, conn = spawned()
    producer = AdapterProducer(conn, ack_timeout_s=30)
    assert producer.send_version(_version(1)).digest == _digest(1)
    chunks = _version(2)
    with pytest.raises(HandoffRejected, match=match) as err:
        for step in order:
            if isinstance(step, tuple):
                chunk, index = AdapterChunk(chunks[step[0]].tensors, 2, False, False), step[1]
            else:
                chunk, index = chunks[step], step
            producer.send_chunk(chunk, index)
    assert "version 2" in str(err.value)
    # nothing of version 2 is active: finishing it is refused, the engine still serves version 1 ...
    with pytest.raises(HandoffRejected, match="no version open"):
        producer.send_chunk(chunks[2], 2)
    # ... and a full resend (as the trainer's next sync does) activates cleanly
    ack = producer.send_version(_version(3))
    assert ack.active_version == 3 and ack.digest == _digest(3)
    producer.close()
    gc.collect()
    assert _segments() == before


# ---------------------------------------------------------------------- adapter checkpoints (what --resume loads)
@pytest.fixture(scope="module")
def run_with_checkpoint(tmp_path_factory):
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import save_peft_adapter
    from k3.model import KimiK3ForCausalLM

    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=2, alpha=4))
    good = run / "adapters" / "rollout_000001"
    save_peft_adapter(model, good)
    torch.save({"rollout_id": 1, "version": 2, "optimizer": {}, "steps": 2}, good / STATE_NAME)
    return run


# A save killed half-way: Loop.save with a trainer that writes a truncated adapter file and then dies.
_KILLED_SAVE = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from types import SimpleNamespace
    from k3.rl.loop import Loop

    run, good = sys.argv[1], Path(sys.argv[2])

    class DyingTrainer:
        def call(self, method, *args):
            out = Path(args[0])
            out.mkdir(parents=True)
            shutil.copy(good / "adapter_config.json", out)
            with open(out / "adapter_model.safetensors", "wb") as f:
                f.write((good / "adapter_model.safetensors").read_bytes()[:100])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    Loop.save(SimpleNamespace(s=SimpleNamespace(run_dir=run), trainer=DyingTrainer(), version=3), 2)
""")


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(run_with_checkpoint):
    run = run_with_checkpoint
    good = run / "adapters" / "rollout_000001"
    died = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(run), str(good)], capture_output=True,
                          text=True, timeout=60)
    assert died.returncode == -signal.SIGKILL, died.stderr
    partial = [p.name for p in (run / "adapters").iterdir() if p.name.startswith(".tmp-rollout_000002-")]
    assert len(partial) == 1 and not (run / "adapters" / "rollout_000002").exists()
    assert latest_checkpoint(run) == good  # the half-written temp dir is not a checkpoint
    assert load_checkpoint_state(good) == {"rollout_id": 1, "version": 2, "optimizer": {}, "steps": 2}
    with pytest.raises(TrainingError, match=r"trainer_state\.pt is missing"):
        load_checkpoint_state(run / "adapters" / partial[0])  # what a non-atomic save would have left


def _damaged_copy(src: Path, dst: Path, damage: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    weights, state, config = (dst / "adapter_model.safetensors", dst / STATE_NAME, dst / "adapter_config.json")
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:-7])
    elif damage == "garbage header":
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    elif damage == "garbage state":
        state.write_bytes(b"not a torch file")
    elif damage == "state without rollout_id":
        torch.save({"steps": 1}, state)
    elif damage == "config not json":
        config.write_text("{r: 2")
    elif damage == "weights missing":
        weights.unlink()
    return dst


@pytest.mark.parametrize("damage, match", [
    ("truncated weights", r"adapter_model\.safetensors is corrupted"),
    ("garbage header", r"adapter_model\.safetensors is corrupted"),
    ("garbage state", r"trainer_state\.pt is corrupted"),
    ("state without rollout_id", r"trainer_state\.pt is corrupted \(no rollout_id in it\)"),
    ("config not json", r"adapter_config\.json is corrupted \(not JSON"),
    ("weights missing", r"adapter_model\.safetensors is missing"),
])
def test_a_corrupted_checkpoint_is_refused_naming_the_file(run_with_checkpoint, tmp_path, damage, match):
    bad = _damaged_copy(run_with_checkpoint / "adapters" / "rollout_000001", tmp_path / "rollout_000002", damage)
    with pytest.raises(TrainingError, match=match) as err:
        load_checkpoint_state(bad)
    assert str(bad) in str(err.value) and "start a fresh --run-dir" in str(err.value)


def test_resume_refuses_a_corrupted_checkpoint_end_to_end(tmp_path, monkeypatch):
    import json

    from k3.config import variant
    from k3.launch.train import main as train_main
    from k3.model import KimiK3ForCausalLM
    from k3.rl.data.arith import write_arith_dataset

    torch.manual_seed(0)
    KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).save_pretrained(tmp_path / "base")
    write_arith_dataset(tmp_path / "data" / "arith", n_train=16, n_eval=4, seed=0)
    run = tmp_path / "run"
    argv = ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "4", "--lr", "1e-3", "--save-interval", "1",
            "--hf-checkpoint", str(tmp_path / "base"), "--data-dir", str(tmp_path / "data"), "--run-dir", str(run)]
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    assert train_main(argv) == 0
    ckpt = latest_checkpoint(run)
    weights = ckpt / "adapter_model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-3])
    assert train_main([*argv, "--resume", "--num-rollout", "2"]) == 1
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["status"] == "failed" and f"checkpoint file {weights} is corrupted" in last["error"]

    # A planted trainer state whose unpickling runs a command: `k3 train --resume` refuses it and never runs it.
    weights.write_bytes(intact)
    marker = tmp_path / "payload-ran"
    state = torch.load(ckpt / STATE_NAME, weights_only=True)
    torch.save({**state, "note": _Planted(marker)}, ckpt / STATE_NAME)
    assert train_main([*argv, "--resume", "--num-rollout", "2"]) == 1
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["status"] == "failed" and f"checkpoint file {ckpt / STATE_NAME} is refused" in last["error"]
    assert not marker.exists()


class _Planted:
    """Unpickles by running a shell command: the payload of a planted ``trainer_state.pt``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


# ---------------------------------------------------------------------- the engine actor killed by Ray mid-sync
def _tiny_run_argv(root: Path, run: Path, num_rollout: int) -> list[str]:
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "4", "--lr", "1e-3", "--save-interval", "1", "--eval-interval", "100",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run)]


@pytest.mark.timeout(240)
def test_engine_actor_killed_by_ray_during_sync_fails_clearly_and_resume_continues(tmp_path, monkeypatch):
    """Real Ray actors: the engine stalls inside the activation of version 3 (so the sync is provably in flight),
    the driver ``ray.kill``s it, the run fails with a TrainingError that says how to go on, nothing of the sync is
    left in ``/dev/shm``, and ``--resume`` continues with the next rollout after the last adapter checkpoint."""
    import json

    ray = pytest.importorskip("ray")
    from k3.config import variant
    from k3.launch.placement import RayPlacement
    from k3.launch.train import main as train_main
    from k3.model import KimiK3ForCausalLM
    from k3.rl.data.arith import write_arith_dataset
    from k3.rl.handles import RayHandle
    from k3.rollout.embedded import start as embedded_start
    from k3.rollout.embedded.worker import EngineWorker

    kill_version = 3  # sync index 2: the sync after rollout 1 (rollout 0 is checkpointed by then)

    class StallingEngine(EngineWorker):  # defined here: Ray ships it by value to the actor
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._stalled = threading.Event()
            activate = self.engine.activate

            def stall_then_activate(version, tensors):
                if version == kill_version:
                    self._stalled.set()
                    threading.Event().wait()  # never returns: the ack of the last chunk never comes
                activate(version, tensors)

            self.engine.activate = stall_then_activate

        def stalled(self) -> bool:
            return self._stalled.is_set()

    handles: dict[str, object] = {}
    create = RayPlacement.create_actor

    def recording_create(self, actor_cls, rank, role="trainer", *args, **kwargs):
        handles[role] = create(self, actor_cls, rank, role, *args, **kwargs)
        return handles[role]

    real_call = RayHandle.call
    killed = []

    def call(self, method, *args):
        if method == "update_weights" and args[0] == kill_version and not killed:
            ref = self.actor.update_weights.remote(*args)
            deadline = time.monotonic() + 60
            while not ray.get(handles["engine"].stalled.remote()):
                assert time.monotonic() < deadline, "the engine never reached the stalled activation"
                time.sleep(0.05)
            ray.kill(handles["engine"], no_restart=True)
            killed.append(time.monotonic())
            return ray.get(ref)
        return real_call(self, method, *args)

    torch.manual_seed(0)
    KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).save_pretrained(tmp_path / "base")
    write_arith_dataset(tmp_path / "data" / "arith", n_train=16, n_eval=4, seed=0)
    run = tmp_path / "run"
    monkeypatch.delenv("K3_IN_PROCESS", raising=False)
    monkeypatch.setattr(RayPlacement, "create_actor", recording_create)
    monkeypatch.setattr(embedded_start, "EngineWorker", StallingEngine)
    monkeypatch.setattr(RayHandle, "call", call)
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("torch_")}

    t0 = time.monotonic()
    assert train_main(_tiny_run_argv(tmp_path, run, num_rollout=3)) == 1
    assert killed and time.monotonic() - killed[0] < 60, "the trainer hung on the dead engine"
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    failed = events[-1]
    assert failed["status"] == "failed"
    assert "adapter sync of version 3 failed" in failed["error"] and "--resume" in failed["error"]
    assert "keeps serving version 2" in failed["error"]
    assert [e["adapter/version"] for e in events if e["event"] == "sync"] == [1, 2]  # version 3 never counted
    assert latest_checkpoint(run).name == "rollout_000000"
    deadline = time.monotonic() + 20  # the dead processes' segments are reaped by torch_shm_manager
    while _segments_of_this_run(shm_before):
        assert time.monotonic() < deadline, ("shared-memory segments of the failed sync were left behind: "
                                             f"{sorted(_segments_of_this_run(shm_before))}")
        time.sleep(0.2)

    monkeypatch.setattr(embedded_start, "EngineWorker", EngineWorker)
    assert train_main([*_tiny_run_argv(tmp_path, run, num_rollout=3), "--resume"]) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e.get("status") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["next_rollout"] == 1
    after = events[events.index(resumed[0]):]
    assert [e["rollout_id"] for e in after if e["event"] == "rollout"] == [1, 2]
    assert events[-1]["status"] == "finished" and latest_checkpoint(run).name == "rollout_000002"
    assert time.monotonic() - t0 < 230


def test_stale_temp_dirs_of_dead_saves_are_removed_and_live_ones_kept(tmp_path):
    from k3.rl.resume import remove_stale_temp_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    adapters = tmp_path / "adapters"
    gone = adapters / f".tmp-rollout_000003-{dead_pid}"
    live = adapters / f".tmp-rollout_000004-{os.getppid()}"
    mine = adapters / f".tmp-rollout_000005-{os.getpid()}"
    done = adapters / "rollout_000002"
    for d in (gone, live, mine, done):
        d.mkdir(parents=True)
        (d / "adapter_model.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in remove_stale_temp_dirs(adapters)) == sorted([gone.name, mine.name])
    assert live.is_dir() and done.is_dir() and not gone.exists() and not mine.exists()
    assert remove_stale_temp_dirs(tmp_path / "no-such-dir") == []


def _segments_of_this_run(before: set[str]) -> set[str]:
    """New ``/dev/shm/torch_<pid>_*`` segments made by this test's processes: this one, its descendants (the local
    Ray's actors) or processes that are gone. Segments of unrelated live processes (another xdist worker) do not
    count."""
    import psutil

    ours = {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}
    left = set()
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("_")
        if name.startswith("torch_") and len(parts) > 1 and parts[1].isdigit():
            pid = int(parts[1])
            if pid in ours or not psutil.pid_exists(pid):
                left.add(name)
    return left
