"""Hand-off: bucket layout, the growing transfer buffer, the receiver's version state machine (in process),
and the protocol between two real processes (delivery, rejection, hold-until-ack, timeouts)."""

from __future__ import annotations

import functools
import gc
import itertools
import math
import os
import re
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.export import AdapterChunk, chunk_layout, export_chunks
from k3.model import KimiK3ForCausalLM
from k3.transport import handoff
from k3.transport.handoff import producer as producer_module
from k3.transport.handoff import (Ack, AdapterProducer, AdapterReceiver, ChunkHeader, HandoffError, HandoffRejected,
                                  HandoffTimeout, TransferBuffer, digest_tensors, flat_views, flatten_into,
                                  spawn_receiver, unflatten)


@pytest.fixture(autouse=True, scope="module")
def _restore_sharing_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


def _tiny_lora(seed=0):
    torch.manual_seed(seed)
    m = apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=4, alpha=8))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return m


def _chunk(version, names_shapes, is_first, is_last, fill=1.0):
    return AdapterChunk([(n, torch.full(s, fill, dtype=torch.bfloat16)) for n, s in names_shapes], version,
                        is_first, is_last)


def _header_bucket(chunk, index):
    tensors = [t for _, t in chunk.tensors]
    bucket = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    flatten_into(bucket, tensors)
    h = ChunkHeader(chunk.version, index, chunk.is_first, chunk.is_last, tuple(chunk.names),
                    tuple(tuple(t.shape) for t in tensors), tensors[0].dtype)
    return h, bucket


# ---------------------------------------------------------------------- layout and buffer
def test_flatten_unflatten_round_trip():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 2, 2)]
    bucket = torch.empty(20)
    prefix = flatten_into(bucket, ts)
    assert prefix.numel() == 14 and prefix.data_ptr() == bucket.data_ptr()
    back = unflatten(prefix, ["a", "b", "c"], [t.shape for t in ts])
    assert [n for n, _ in back] == ["a", "b", "c"] and all(torch.equal(x, t) for (_, x), t in zip(back, ts))
    with pytest.raises(ValueError, match="holds 20 elements, the chunk needs 24"):
        flatten_into(bucket, ts + [torch.zeros(10)])
    with pytest.raises(ValueError, match="header's shapes need 12"):
        unflatten(prefix, ["a", "b"], [(2, 3), (6,)])


def test_digest_is_bit_exact():
    a = [("x", torch.tensor([1.0, 2.0], dtype=torch.bfloat16))]
    assert digest_tensors(a) == digest_tensors([("x", torch.tensor([1.0, 2.0], dtype=torch.bfloat16))])
    assert digest_tensors(a) != digest_tensors([("x", torch.tensor([1.0, 2.015625], dtype=torch.bfloat16))])
    assert digest_tensors(a) != digest_tensors([("y", a[0][1])])


def test_transfer_buffer_reuses_and_grows():
    buf = TransferBuffer("cpu", torch.float32)
    v = buf.stage([torch.arange(10.0)])
    assert buf.capacity == 10 and buf.grows == 0 and torch.equal(v, torch.arange(10.0))
    assert v.is_shared()  # allocated in shared memory once, so sending it never moves it
    ptr = v.data_ptr()
    assert buf.stage([torch.ones(5)]).data_ptr() == ptr and buf.grows == 0
    buf.stage([torch.ones(12)])
    assert (buf.capacity, buf.grows) == (20, 1)  # max(needed, 2 x old)
    buf.stage([torch.ones(50)])
    assert (buf.capacity, buf.grows) == (50, 2)


def test_transfer_buffer_grows_past_the_recipes_512_mib_cap():
    """The recipe's buffer is max(first chunk, 512 MiB) and asserts on a larger chunk: the routed-expert chunk
    at rank 33 has 33·8,268,288 BF16 elements (> 512 MiB). Here it grows (meta tensors: no allocation)."""
    buf = TransferBuffer("meta", torch.bfloat16, initial_numel=(512 << 20) // 2)
    with torch.device("meta"):
        m = apply_lora(KimiK3ForCausalLM(variant("4layer")), LoRAConfig(rank=33, alpha=66))
    routed = next(c for c in export_chunks(m, 1) if c.group == "routed_experts")
    assert sum(t.numel() for _, t in routed.tensors) == 33 * 8_268_288 > (512 << 20) // 2
    view = buf.stage([t for _, t in routed.tensors])
    assert view.numel() == 33 * 8_268_288 and buf.grows == 1 and buf.capacity == 2 * (512 << 20) // 2


# ---------------------------------------------------------------------- receiver state machine
A = [("a.lora_A.weight", (2, 3)), ("a.lora_B.weight", (4, 2))]
B = [("b.lora_A.weight", (2, 3))]
EXPECTED = dict(A + B)


def _send(rx, chunks):
    return [rx.receive(*_header_bucket(c, i)) for i, c in enumerate(chunks)]


def test_receiver_activates_only_a_complete_version():
    seen = []
    rx = AdapterReceiver(EXPECTED, on_activate=lambda v, t, c: seen.append((v, sorted(t), t["a.lora_B.weight"])))
    first = rx.receive(*_header_bucket(_chunk(1, A, True, False), 0))
    assert first.ok and rx.active_version == 0 and not seen  # half delivered: nothing active yet
    last = rx.receive(*_header_bucket(_chunk(1, B, False, True), 1))
    assert last.ok and rx.active_version == 1 and last.active_version == 1
    assert [s[:2] for s in seen] == [(1, sorted(EXPECTED))]
    assert torch.equal(seen[0][2], torch.ones(4, 2, dtype=torch.bfloat16))
    assert last.digest == digest_tensors(list(_chunk(1, A, 1, 0).tensors) + list(_chunk(1, B, 0, 1).tensors))
    assert rx.active == {}  # the engine owns the adapter; the receiver keeps no second copy


@pytest.mark.parametrize("stream, match", [
    ([_chunk(2, A, False, False)], "no version open"),
    ([_chunk(2, A, True, False), _chunk(3, B, False, True)], "carries version 3 inside version 2"),
    ([_chunk(2, A, True, False), _chunk(2, A, False, True)], "delivered twice"),
    ([_chunk(2, A, True, False), _chunk(2, [("c.lora_A.weight", (2, 3))], False, True)], "unexpected"),
    ([_chunk(2, A, True, False), _chunk(2, [("b.lora_A.weight", (3, 2))], False, True)], r"shape \(3, 2\)"),
    ([_chunk(2, A, True, True)], "1 adapter tensors missing"),
])
def test_receiver_rejects_a_bad_stream_and_keeps_the_old_version(stream, match):
    rx = AdapterReceiver(EXPECTED)
    assert all(a.ok for a in _send(rx, [_chunk(1, A, True, False), _chunk(1, B, False, True)]))
    old = dict(rx.active)
    acks = _send(rx, stream)
    assert all(a.ok for a in acks[:-1]) and not acks[-1].ok
    assert re.search(match, acks[-1].error), acks[-1].error
    assert rx.active_version == 1 and rx.active.keys() == old.keys()
    assert all(torch.equal(rx.active[k], old[k]) for k in old)
    # the half-built version is gone: continuing it is refused, a fresh version is accepted
    assert not rx.receive(*_header_bucket(_chunk(2, B, False, True), 1)).ok
    assert all(a.ok for a in _send(rx, [_chunk(5, A, True, False), _chunk(5, B, False, True)]))
    assert rx.active_version == 5


def test_receiver_rejects_stale_versions_out_of_order_chunks_and_bad_buckets():
    rx = AdapterReceiver(EXPECTED)
    _send(rx, [_chunk(3, A, True, False), _chunk(3, B, False, True)])
    assert "not newer than the active version 3" in rx.receive(*_header_bucket(_chunk(3, A, True, False), 0)).error
    rx.receive(*_header_bucket(_chunk(4, A, True, False), 0))
    assert "chunk index 2, expected 1" in rx.receive(*_header_bucket(_chunk(4, B, False, True), 2)).error
    h, bucket = _header_bucket(_chunk(6, A, True, False), 0)
    assert "header describes 14 elements" in rx.receive(h, bucket[:-1]).error
    assert rx.active_version == 3 and rx.rejected == 3


def test_a_new_first_chunk_replaces_a_half_built_version():
    rx = AdapterReceiver(EXPECTED)
    rx.receive(*_header_bucket(_chunk(1, A, True, False), 0))  # producer died after the first chunk
    assert all(a.ok for a in _send(rx, [_chunk(2, A, True, False, fill=7.0), _chunk(2, B, False, True)]))
    assert rx.active_version == 2 and float(rx.active["a.lora_A.weight"][0, 0]) == 7.0


def test_a_failing_engine_load_is_a_rejection():
    def boom(v, t, c):
        raise RuntimeError("engine out of memory")
    rx = AdapterReceiver(EXPECTED, on_activate=boom)
    acks = _send(rx, [_chunk(1, A, True, False), _chunk(1, B, False, True)])
    assert not acks[-1].ok and "engine out of memory" in acks[-1].error and rx.active_version == 0


def test_producer_refuses_malformed_streams_before_sending():
    class NoConn:
        def send(self, obj):
            raise AssertionError("nothing may be sent")
    p = AdapterProducer(NoConn())
    with pytest.raises(HandoffError, match="not marked is_first"):
        p.send_version([_chunk(1, A, False, True)])
    with pytest.raises(HandoffError, match="no chunks"):
        p.send_version([])
    with pytest.raises(HandoffError, match="mixes dtypes"):
        p.send_chunk(AdapterChunk([("x", torch.zeros(2)), ("y", torch.zeros(2, dtype=torch.bfloat16))], 1, True, True), 0)
    with pytest.raises(ValueError, match="ack_timeout_s"):
        AdapterProducer(NoConn(), ack_timeout_s=0)


# ---------------------------------------------------------------------- two processes
class _DelayedReceiver(AdapterReceiver):
    """Acks after ``delay`` seconds (a lagging engine)."""

    def __init__(self, delay: float, **kw) -> None:
        super().__init__(**kw)
        self.delay = delay

    def receive(self, header, bucket):
        time.sleep(self.delay)
        return super().receive(header, bucket)


def _make_receiver(delay: float = 0.0) -> AdapterReceiver:
    m = _tiny_lora()
    expected = {n: tuple(t.shape) for c in export_chunks(m, 0) for n, t in c.tensors}
    return _DelayedReceiver(delay, expected=expected)


def _torch_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")}


_VERSIONS = itertools.count(1)  # versions for the module's receiver, below the rejected test's 50


@pytest.fixture(scope="module")
def receiver():
    proc, conn = spawn_receiver(_make_receiver)
    yield proc, conn
    conn.send("close")
    proc.join(timeout=30)
    assert proc.exitcode == 0


@pytest.mark.parametrize("buffered", [False, True])
@pytest.mark.parametrize("in_place", [False, True], ids=["copied-in", "exported-in-place"])
def test_versions_arrive_bit_exact_across_processes(receiver, buffered, in_place, monkeypatch):
    _, conn = receiver
    m = _tiny_lora()
    buffer = TransferBuffer("cpu", torch.bfloat16) if buffered else None
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=30)
    copies = []  # staging copies: none when every chunk is exported into its bucket
    real_stage, real_flatten = TransferBuffer.stage, handoff.flatten_into
    monkeypatch.setattr(TransferBuffer, "stage", lambda self, ts: copies.append("stage") or real_stage(self, ts))
    # the fresh-bucket copy, as the producer calls it
    monkeypatch.setattr(producer_module, "flatten_into", lambda b, ts: copies.append("flatten") or real_flatten(b, ts))
    before = _torch_segments()  # CUDA IPC ref-counter files of earlier tests in this process may linger
    for v in (next(_VERSIONS), next(_VERSIONS)):  # the module's receiver takes only newer versions
        with torch.no_grad():
            m.model.layers[2].block_sparse_moe.experts.w2_lora_B.add_(1.0)  # every version differs
        want = digest_tensors([kv for c in export_chunks(m, v) for kv in c.tensors])
        ack = producer.send_version(export_chunks(m, v, out=producer.bucket_for if in_place else None))
        assert ack.ok and ack.active_version == v and ack.digest == want
    assert not producer.unacked
    assert (len(copies) == 0) if in_place else (len(copies) == 2 * len(chunk_layout(m.config, m.lora_config)))
    gc.collect()
    if buffered:
        largest = max(sum(t.numel() for _, t in c.tensors) for c in export_chunks(m, 0))
        assert largest <= buffer.capacity < 2 * largest  # grown to fit the largest chunk, and no further
        assert len(_torch_segments() - before) == 1  # one persistent segment for the whole run
        buffer.release()
        gc.collect()
        # the receiver keeps the persistent buffer mapped until its close (checked after the close in
        # test_the_persistent_buffer_is_mapped_once_per_run_and_fresh_buckets_once_per_chunk)
        assert len(_torch_segments() - before) == 1
    else:
        assert _torch_segments() == before


def test_a_rejected_version_raises_and_the_engine_keeps_the_old_one(receiver):
    _, conn = receiver
    m = _tiny_lora()
    producer = AdapterProducer(conn, ack_timeout_s=30)
    ok = producer.send_version(export_chunks(m, 50))
    with pytest.raises(HandoffRejected, match="not newer than the active version 50"):
        producer.send_version(export_chunks(m, 50))
    chunks = list(export_chunks(m, 51))
    bad = AdapterChunk(chunks[1].tensors[:1], 51, False, False)  # the dense chunk without 5 of its 6 tensors
    producer.send_chunk(chunks[0], 0)
    producer.send_chunk(bad, 1)
    with pytest.raises(HandoffRejected, match="5 adapter tensors missing"):
        for i, c in enumerate(chunks[2:], start=2):
            producer.send_chunk(c, i)
    with pytest.raises(HandoffRejected, match="no version open"):
        producer.send_chunk(chunks[1], 1)
    again = producer.send_version(export_chunks(m, 52))
    assert again.digest == ok.digest  # same adapter values, now active as version 52


def test_the_bucket_is_held_until_ack_and_barrier_then_freed():
    proc, conn = spawn_receiver(functools.partial(_make_receiver, 0.2))
    try:
        refs, at_barrier = [], []
        producer = None
        before = _torch_segments()

        def barrier():
            # the ack is in, the bucket has not been released yet
            at_barrier.append(all(r() is not None for r in refs[-1:]) and len(producer.unacked) == 1)

        producer = AdapterProducer(conn, ack_timeout_s=30, barrier=barrier,
                                   on_bucket=lambda b: refs.append(weakref.ref(b.untyped_storage())))
        chunks = list(export_chunks(_tiny_lora(), 1))[:3]
        chunks = [AdapterChunk(c.tensors, 1, i == 0, False) for i, c in enumerate(chunks)]
        for i, c in enumerate(chunks):
            producer.send_chunk(c, i)
        gc.collect()
        assert at_barrier == [True, True, True]
        assert all(r() is None for r in refs)  # released after each ack
        assert _torch_segments() == before

        # an ack that does not come in time: the bucket stays held, collect() frees it when the ack lands
        producer.ack_timeout_s = 0.05
        nxt = list(export_chunks(_tiny_lora(), 1))[3]
        with pytest.raises(HandoffTimeout, match="stays held"):
            producer.send_chunk(AdapterChunk(nxt.tensors, 1, False, False), 3)
        assert list(producer.unacked) == [(1, 3)] and len(_torch_segments() - before) == 1
        deadline = time.monotonic() + 10
        while producer.collect() and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
        assert not producer.unacked and _torch_segments() == before
        producer.close()
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_dead_receiver_is_a_clear_error():
    proc, conn = spawn_receiver(_make_receiver)
    proc.kill()
    proc.join()
    producer = AdapterProducer(conn, ack_timeout_s=5)
    with pytest.raises(HandoffError, match="receiver"):
        producer.send_version(export_chunks(_tiny_lora(), 1))


def test_a_receiver_in_the_same_process_gets_tokens_not_ipc_handles_and_the_buckets_are_freed(tmp_path):
    """``k3 train`` without Ray: engine and trainer share a process, where CUDA cannot open its own IPC handles.
    The producer registers each bucket locally and sends a ``LocalBucket`` token; versions still arrive bit-exact
    and every bucket is freed after its ack."""
    import threading
    from multiprocessing.connection import Client, Listener

    from k3.rl.trainer_worker import _peer_pid
    from k3.transport import handoff

    path, key = str(tmp_path / "adapter.sock"), b"k" * 16
    listener = Listener(path, family="AF_UNIX", authkey=key)
    rx = _make_receiver()
    seen: list[type] = []
    thread = threading.Thread(target=lambda: handoff.serve(_Recording(listener.accept(), seen), rx), daemon=True)
    thread.start()
    conn = Client(path, family="AF_UNIX", authkey=key)
    assert _peer_pid(conn) == os.getpid()
    refs: list[weakref.ref] = []
    producer = AdapterProducer(conn, ack_timeout_s=30, same_process=True,
                               on_bucket=lambda b: refs.append(weakref.ref(b.untyped_storage())))
    m = _tiny_lora()
    want = digest_tensors([kv for c in export_chunks(m, 3) for kv in c.tensors])
    ack = producer.send_version(export_chunks(m, 3))
    assert ack.ok and ack.active_version == 3 and ack.digest == want
    assert seen and set(seen) == {handoff.LocalBucket}
    gc.collect()
    assert refs and all(r() is None for r in refs) and not handoff.LOCAL_BUCKETS and not producer.unacked
    producer.close()
    thread.join(timeout=10)
    listener.close()
    assert not thread.is_alive()


class _Recording:
    """A connection that notes the type of every bucket it receives."""

    def __init__(self, conn, seen):
        self.conn, self.seen = conn, seen

    def recv(self):
        msg = self.conn.recv()
        if isinstance(msg, tuple):
            self.seen.append(type(msg[1]))
        return msg

    def send(self, obj):
        self.conn.send(obj)


class _CountingOpens(AdapterReceiver):
    """Counts how often this (receiver) process maps a shared-memory segment anew; the count comes back in the
    last chunk's ack as ``error`` (test-only)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.opens = 0
        original = torch.UntypedStorage._new_shared_filename_cpu

        def counting(*args, **kwargs):
            self.opens += 1
            return original(*args, **kwargs)

        torch.UntypedStorage._new_shared_filename_cpu = counting

    def receive(self, header, bucket):
        import dataclasses

        ack = super().receive(header, bucket)
        return dataclasses.replace(ack, error=str(self.opens)) if header.is_last else ack


def _make_counting_receiver() -> AdapterReceiver:
    m = _tiny_lora()
    return _CountingOpens(expected={n: tuple(t.shape) for c in export_chunks(m, 0) for n, t in c.tensors})


@pytest.mark.parametrize("buffered", [False, True])
def test_the_persistent_buffer_is_mapped_once_per_run_and_fresh_buckets_once_per_chunk(buffered):
    proc, conn = spawn_receiver(_make_counting_receiver)
    try:
        before = _torch_segments()
        m = _tiny_lora()
        chunks = list(export_chunks(m, 1))
        buffer = TransferBuffer("cpu", torch.bfloat16, initial_numel=max(
            sum(t.numel() for _, t in c.tensors) for c in chunks)) if buffered else None
        producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=30)
        ack = producer.send_version(iter(chunks))
        assert ack.ok and int(ack.error) == (1 if buffered else len(chunks))
        ack = producer.send_version(export_chunks(m, 2))  # the persistent mapping is still open: no new open
        assert ack.ok and int(ack.error) == (1 if buffered else 2 * len(chunks))
        producer.close()
        proc.join(timeout=30)
        assert proc.exitcode == 0
        if buffer is not None:
            buffer.release()
        gc.collect()
        assert _torch_segments() == before  # nothing is held by either side after the close
    finally:
        if proc.is_alive():
            proc.kill()


class _RecordingPayloads(_Recording):
    """Notes every chunk payload itself (a ``BufferSlice`` is small and picklable, so keeping it is harmless)."""

    def recv(self):
        msg = self.conn.recv()
        if isinstance(msg, tuple):
            self.seen.append(msg[1])
        return msg


def _serve_in_thread(tmp_path, receiver, seen):
    """``serve`` on a Unix socket in a thread of this process; returns the producer's connection and the thread."""
    import threading
    from multiprocessing.connection import Client, Listener

    path, key = str(tmp_path / "adapter.sock"), b"k" * 16
    listener = Listener(path, family="AF_UNIX", authkey=key)
    from k3.transport import handoff

    thread = threading.Thread(target=lambda: handoff.serve(_RecordingPayloads(listener.accept(), seen), receiver),
                              daemon=True)
    thread.start()
    conn = Client(path, family="AF_UNIX", authkey=key)
    return conn, thread, listener


@pytest.mark.parametrize("same_process", [False, True])
def test_the_transfer_buffer_is_shared_once_per_generation_and_chunks_travel_as_headers(tmp_path, same_process):
    """Only the first chunk of a buffer generation carries the buffer; every other chunk is a ``BufferSlice`` of
    two integers. A grown buffer is a new generation, shared again with the chunk that needed it."""
    from k3.transport.handoff import BufferSlice

    seen: list = []
    rx = _make_receiver()
    # Without same_process the payloads go through torch's pickler as between two processes (a CPU buffer is
    # mapped again from its /dev/shm name); with it, the buffer travels as a LocalBucket token.
    conn, thread, listener = _serve_in_thread(tmp_path, rx, seen)
    m = _tiny_lora()
    chunks = list(export_chunks(m, 1))
    sizes = [sum(t.numel() for _, t in c.tensors) for c in chunks]
    buffer = TransferBuffer("cpu", torch.bfloat16, initial_numel=min(sizes))
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=30, same_process=same_process)
    for v in (1, 2):
        want = digest_tensors([kv for c in export_chunks(m, v) for kv in c.tensors])
        ack = producer.send_version(export_chunks(m, v))
        assert ack.ok and ack.active_version == v and ack.digest == want
    assert all(isinstance(p, BufferSlice) for p in seen) and len(seen) == 2 * len(chunks)
    carrying = [i for i, p in enumerate(seen) if p.buffer is not None]
    generations = [p.generation for p in seen]
    # generation 1 (the initial allocation) goes with chunk 0; each growth goes with the chunk that caused it
    grown_at = [i for i in range(1, len(seen)) if generations[i] != generations[i - 1]]
    assert carrying == [0] + grown_at and generations[-1] == buffer.generation == 1 + buffer.grows
    assert all(p.numel == n for p, n in zip(seen, sizes + sizes))
    assert all(p.event is None for p in seen)  # CPU: copies are synchronous, there is no event to wait on
    producer.close()
    thread.join(timeout=10)
    listener.close()
    assert not thread.is_alive()
    from k3.transport import handoff
    assert not handoff.LOCAL_BUCKETS


def test_a_slice_of_a_generation_the_receiver_never_mapped_is_refused_and_the_stream_goes_on(tmp_path):
    from k3.transport.handoff import BufferSlice

    rx = _make_receiver()
    conn, thread, listener = _serve_in_thread(tmp_path, rx, [])
    m = _tiny_lora()
    first = next(iter(export_chunks(m, 1)))
    header, _ = _header_bucket(first, 0)
    conn.send((header, BufferSlice(generation=3, numel=header.numel)))
    ack = conn.recv()
    assert not ack.ok and "generation 3" in ack.error and "never shared" in ack.error and rx.rejected == 1
    # the same receiver still takes a proper stream afterwards
    producer = AdapterProducer(conn, transfer_buffer=TransferBuffer("cpu", torch.bfloat16), ack_timeout_s=30)
    assert producer.send_version(export_chunks(m, 1)).ok
    # a slice of an older generation than the one mapped is refused too
    conn.send((header, BufferSlice(generation=0, numel=header.numel)))
    ack = conn.recv()
    assert not ack.ok and "generation 0" in ack.error and "is the one mapped here" in ack.error
    producer.close()
    thread.join(timeout=10)
    listener.close()


class _AckingConn:
    """A producer-side stand-in for a receiver: records each payload and acks it at once."""

    def __init__(self):
        self.payloads = []
        self._acks = []

    def send(self, obj):
        if isinstance(obj, tuple):
            header, payload = obj
            self.payloads.append(payload)
            self._acks.append(Ack(header.version, header.index, ok=True, active_version=header.version))

    def poll(self, timeout=None):
        return bool(self._acks)

    def recv(self):
        return self._acks.pop(0)


def test_the_interprocess_event_handle_travels_once_and_each_buffer_once_per_generation(monkeypatch):
    """On CUDA the transfer buffer records one interprocess event behind every staged copy. Its handle goes to the
    receiver once (the receiver keeps the event across a grown buffer); each generation's buffer goes once. The
    event is faked here (CPU): the protocol, not CUDA, is under test."""
    from k3.transport.handoff import BufferSlice

    class FakeEvent:
        def ipc_handle(self):
            return b"event-handle"

    real_stage = TransferBuffer.stage

    def stage(self, tensors):
        prefix = real_stage(self, tensors)
        self._event = self._event or FakeEvent()
        return prefix

    monkeypatch.setattr(TransferBuffer, "stage", stage)
    conn = _AckingConn()
    buffer = TransferBuffer("cpu", torch.bfloat16, initial_numel=1)
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=5)
    m = _tiny_lora()
    for v in (1, 2):
        assert producer.send_version(export_chunks(m, v)).ok
    slices = conn.payloads
    assert all(isinstance(s, BufferSlice) for s in slices) and buffer.grows >= 2
    assert [i for i, s in enumerate(slices) if s.event is not None] == [0]
    assert slices[0].event == b"event-handle"
    new_generation = [i for i, s in enumerate(slices) if i == 0 or s.generation != slices[i - 1].generation]
    assert [i for i, s in enumerate(slices) if s.buffer is not None] == new_generation and len(new_generation) >= 3


# ---------------------------------------------------------------------- exporting in place
@pytest.mark.parametrize("buffered", [False, True])
def test_a_chunk_exported_into_bucket_for_is_sent_without_a_copy_and_anything_else_is_copied(buffered, monkeypatch):
    conn = _AckingConn()
    buffer = TransferBuffer("cpu", torch.bfloat16) if buffered else None
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=5)
    copies = []
    real_stage, real_flatten = TransferBuffer.stage, handoff.flatten_into
    monkeypatch.setattr(TransferBuffer, "stage", lambda self, ts: copies.append("stage") or real_stage(self, ts))
    # the fresh-bucket copy, as the producer calls it
    monkeypatch.setattr(producer_module, "flatten_into", lambda b, ts: copies.append("flatten") or real_flatten(b, ts))
    names, shapes = [n for n, _ in A], [s for _, s in A]
    sizes = [math.prod(s) for s in shapes]
    ref = [torch.arange(n, dtype=torch.bfloat16).view(s) + 10 * i for i, (n, s) in enumerate(zip(sizes, shapes))]
    want = torch.cat([r.reshape(-1) for r in ref])

    def send(tensors, version):
        ack = producer.send_chunk(AdapterChunk(list(zip(names, tensors)), version, True, True), 0)
        payload = conn.payloads[-1]
        return ack, (buffer.buffer[:payload.numel] if buffered else payload)

    dest = producer.bucket_for(sum(sizes), torch.bfloat16, "cpu")
    views = flat_views(dest, shapes)
    for v, r in zip(views, ref):
        v.copy_(r)
    ack, sent = send(views, 1)
    assert ack.ok and copies == [] and torch.equal(sent, want)
    assert sent.data_ptr() == dest.data_ptr()  # the destination itself travelled
    assert buffered or dest.is_shared()  # a fresh CPU bucket is born in shared memory: pickling copies nothing

    # Views of the destination in the wrong order, or tensors elsewhere: copied in, as any chunk is.
    dest = producer.bucket_for(sum(sizes), torch.bfloat16, "cpu")
    swapped = [dest[sizes[1]:].view(shapes[0]), dest[:sizes[1]].view(shapes[1])]
    for v, r in zip(swapped, ref):
        v.copy_(r)
    ack, sent = send(swapped, 2)
    assert ack.ok and copies == ["stage" if buffered else "flatten"] and torch.equal(sent, want)
    producer.bucket_for(sum(sizes), torch.bfloat16, "cpu")
    ack, sent = send([r.clone() for r in ref], 3)
    assert ack.ok and len(copies) == 2 and torch.equal(sent, want)


def test_bucket_for_refuses_an_occupied_transfer_buffer_and_another_dtype():
    class Silent(_AckingConn):
        def poll(self, timeout=None):
            return False

    producer = AdapterProducer(Silent(), transfer_buffer=TransferBuffer("cpu", torch.bfloat16), ack_timeout_s=0.05)
    with pytest.raises(HandoffError, match="float32 on cpu does not fit the transfer buffer \\(torch.bfloat16 on cpu"):
        producer.bucket_for(6, torch.float32, "cpu")
    dest = producer.bucket_for(6, torch.bfloat16, "cpu")
    with pytest.raises(HandoffTimeout):
        producer.send_chunk(AdapterChunk([("a.lora_A.weight", dest.view(2, 3))], 1, True, True), 0)
    with pytest.raises(HandoffError, match="never acked; the transfer buffer they sit in cannot be overwritten"):
        producer.bucket_for(6, torch.bfloat16, "cpu")
    producer.close()
    with pytest.raises(HandoffError, match="producer is closed"):
        producer.bucket_for(6, torch.bfloat16, "cpu")


def test_export_into_given_tensors_equals_the_plain_export_bit_for_bit():
    m = _tiny_lora()
    flats = []

    def out(numel, dtype, device):
        flats.append(torch.full((numel,), float("nan"), dtype=dtype, device=device))
        return flats[-1]

    plain = list(export_chunks(m, 3))
    placed = list(export_chunks(m, 3, out=out))
    assert len(flats) == len(plain) == len(placed)
    for p, q, flat in zip(plain, placed, flats):
        assert p.names == q.names
        assert (p.is_first, p.is_last, p.group, p.layer) == (q.is_first, q.is_last, q.group, q.layer)
        for (_, a), (_, b) in zip(p.tensors, q.tensors):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
        at = flat.data_ptr()
        for _, b in q.tensors:  # consecutive views of the given tensor, covering it
            assert b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and b.data_ptr() == at
            at += b.numel() * b.element_size()
        assert at == flat.data_ptr() + flat.numel() * flat.element_size()
    with pytest.raises(ValueError, match="the chunk's tensors need 10 elements, its destination has 12"):
        flat_views(torch.empty(12), [(2, 3), (4,)])


def test_a_destination_the_exporter_never_sent_is_dropped_at_close():
    producer = AdapterProducer(_AckingConn(), ack_timeout_s=5)
    dest = weakref.ref(producer.bucket_for(6, torch.bfloat16, "cpu"))  # the export failed before sending it
    gc.collect()
    assert dest() is not None and dest().is_shared()  # the producer still holds it ...
    producer.close()
    gc.collect()
    assert dest() is None  # ... until the close: its shared-memory segment goes with it
