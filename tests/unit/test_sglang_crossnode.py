"""Adapters into an SGLang engine that spans nodes, on CPU (issue #22 item 5, recipe §4.5).

Four trainer ranks in four processes joined by gloo, ranks 0-1 on simulated node A (GPUs 0, 1) and 2-3 on node B
(GPUs 0, 1), feed one engine of TP 4 that spans both nodes: the real head worker (``SGLangEngineWorker``, with its
forwarder and feed) on the test-only ``sglang`` (tests/fake_sglang), which records, for every load and engine
rank, the process that made the payload that rank opened (the pid in the name of its shared-memory segment). Every
rank holds its own full copy of each chunk (as the megatron export gives every rank every chunk:
tests/parity/test_megatron_pp_export.py), makes its own payload (``FedProducer``), and the payloads meet at the
source over the feed's Gloo group. Checked:

* every engine rank's payload was made by the trainer rank on its GPU, on its own node, and the adapter SGLang
  holds is the trained one, bit for bit; the engine reports the trainer's chunk digests; fresh buckets and the
  persistent transfer buffer alike;
* a rank that cannot make its payload, a rank whose copy of a chunk differs, and a rank on the wrong node each
  refuse the chunk with one message naming the engine, the engine rank, the trainer rank, the node and GPU, and the
  chunk, on every trainer rank; nothing of that version is activated, and the engine takes the next version;
* the pure parts: the placement (ranks that interleave over nodes are refused; the head's visible GPUs must be its
  engine ranks'), the checks, the payload bytes, the head's feed plan, ``connect_engines``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from k3.config import variant
from k3.lora import LoRAConfig
from k3.lora.digest import chunk_digest
from k3.lora.export import AdapterChunk, chunk_layout
from k3.rollout.sglang.placement import engine_rank_slots, plan_engine_nodes
from k3.settings.lora import target_names
from k3.transport.handoff import HandoffError, HandoffRejected
from k3.transport.rank_feed import (RankFeed, RankFeedError, RankPayload, RankPayloads, RankSlot,
                                    check_member_placement, check_rank_payloads, this_gpu)

FAKE = Path(__file__).resolve().parents[1] / "fake_sglang"
NODES = ("node-a", "node-a", "node-b", "node-b")  # trainer rank -> its (simulated) node
GPUS = ("0", "1", "0", "1")  # trainer rank -> its GPU on that node
WORLD = len(NODES)
RANK = 4
CHILD_TIMEOUT_S = 240


# ============================================================================ fixtures
# fake_sglang: tests/conftest.py
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint dir as the head reads it: config.json (chunk layout, byte tokenizer)."""
    root = tmp_path_factory.mktemp("crossnode") / "base"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(variant("tiny").replace(quantization_config=None).to_hf_dict()))
    return root


def lora() -> LoRAConfig:
    return LoRAConfig(rank=RANK, alpha=2.0 * RANK, dropout=0.0, target_modules=target_names())


def adapter(version: int) -> list[AdapterChunk]:
    """The adapter of ``version`` as every trainer rank holds it (the same values on every rank), in chunks."""
    layout = chunk_layout(variant("tiny"), lora())
    g = torch.Generator().manual_seed(1000 + version)
    out = []
    for k, c in enumerate(layout):
        made: dict[str, torch.Tensor] = {}
        tensors = []
        for name, shape in c.tensors:
            tied = made.get(name.replace(".up_proj.lora_A.", ".gate_proj.lora_A."))  # fc1's shared lora_A
            made[name] = tied if tied is not None else torch.randn(*shape, generator=g) * 0.01
            tensors.append((name, made[name]))
        out.append(AdapterChunk(tensors, version, k == 0, k == len(layout) - 1, config=lora().peft_config()))
    return out


def plan_slots() -> tuple[RankSlot, ...]:
    (nodes,) = plan_engine_nodes(1, WORLD, [(NODES[r], [GPUS[r]]) for r in range(WORLD)])
    return engine_rank_slots(nodes)


def start_head(model_dir: Path, streamed: bool = True, slots=None):
    from sglang.srt.managers import io_struct

    from k3.rollout.sglang.server_args import build_server_args, settings_from_dict
    from k3.rollout.sglang.worker import SGLangEngineWorker
    from k3.settings.worker import WorkerSpec

    io_struct.use_recipe_build(streamed)
    spec = WorkerSpec(model_dir=str(model_dir), lora=lora())
    worker = SGLangEngineWorker(spec, sglang_path=str(FAKE), rank_slots=plan_slots() if slots is None else slots)
    settings = settings_from_dict({"hf_checkpoint": str(model_dir), "model_variant": "tiny",
                                   "rollout_num_gpus_per_engine": WORLD, "num_gpus_per_node": 2,
                                   "lora_rank": RANK, "target_modules": list(target_names())})
    worker.start(build_server_args(*settings, dist_init_addr="node-a:30000", node_rank=0))
    return worker


# ============================================================================ the trainer ranks (child processes)
def _failing_maker(make, chunk_index: int):
    def make_payload(bucket, names, shapes, with_checksums):
        if make_payload.calls == chunk_index:
            raise RuntimeError("the rank's device ran out of memory making its bucket")
        make_payload.calls += 1
        return make(bucket, names, shapes, with_checksums)

    make_payload.calls = 0
    return make_payload


def _trainer_rank(rank: int, init: str, feed: RankFeed, address: str, authkey: bytes, steps: list[dict],
                  buffered: bool, out) -> None:
    """One trainer rank: join the engine's feed, send each step's version; report what happened."""
    import torch.distributed as dist

    from k3.transport.fed_producer import FedProducer
    from k3.transport.feed_group import join_feeds
    from k3.transport.handoff import TransferBuffer

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=CHILD_TIMEOUT_S))
        group = join_feeds([feed], rank, NODES[rank], GPUS[rank], timeout=timedelta(seconds=CHILD_TIMEOUT_S))
        conn = None
        if group.is_source:
            from multiprocessing.connection import Client

            conn = Client(address, family="AF_UNIX", authkey=authkey)
        buffer = TransferBuffer("cpu", torch.float32) if buffered else None
        producer = FedProducer(conn, group, chunk_digest, transfer_buffer=buffer, ack_timeout_s=CHILD_TIMEOUT_S)
        results = []
        for step in steps:
            version, fault = step["version"], step.get("fault")
            chunks = adapter(version)
            home_feed, home_node = group.feed, group.node
            if fault and fault[1] == rank:
                if fault[0] == "fails":  # this rank cannot make its payload of chunk fault[2]
                    group.feed = dataclasses.replace(feed, make_payload=_failing_maker(feed.make_payload, fault[2]))
                elif fault[0] == "differs":  # this rank's copy of chunk fault[2] is not the source's
                    name, t = chunks[fault[2]].tensors[0]
                    chunks[fault[2]].tensors[0] = (name, t + 1.0)
                elif fault[0] == "node":  # this rank runs on another node than its engine rank
                    group.node = fault[2]
            try:
                ack = producer.send_version(chunks)
                results.append({"version": version, "ok": True, "digests": list(producer.version_digests),
                                "active": ack.active_version})
            except HandoffError as e:
                results.append({"version": version, "ok": False, "error": f"{type(e).__name__}: {e}"})
            group.feed, group.node = home_feed, home_node
        producer.close()
        dist.destroy_process_group()
        out.put((rank, os.getpid(), results, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        out.put((rank, os.getpid(), None, traceback.format_exc()))
        raise SystemExit(1) from e


def run_ranks(tmp_path: Path, worker, steps: list[dict], buffered: bool = False) -> dict[int, tuple[int, list]]:
    """The four trainer ranks, each in its own spawned process, against the head ``worker``: ``{rank: (pid,
    results)}``."""
    import torch.multiprocessing as mp

    address, authkey = worker.listen()
    feed = worker.rank_feed()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'gloo-store'}"
    procs = [ctx.Process(target=_trainer_rank, args=(r, init, feed, address, authkey, steps, buffered, out),
                         daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[int, tuple[int, list]] = {}
    try:
        for _ in range(WORLD):
            rank, pid, results, error = out.get(timeout=CHILD_TIMEOUT_S)
            assert error is None, f"trainer rank {rank} failed:\n{error}"
            got[rank] = (pid, results)
    finally:
        # Polled, not joined: a rank's torch_shm_manager outlives it while this process maps its segments, and
        # holds the pipe ``join`` waits on.
        deadline = time.monotonic() + 30
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
    return got


def loads(sglang) -> list[dict]:
    return [d for _, call, d in sglang.TIMELINE if call == "load_lora_adapter_from_tensors"]


# ============================================================================ two nodes, one engine
STEPS = [{"version": 1},
         {"version": 2},
         {"version": 3, "fault": ("fails", 3, 1)},  # trainer rank 3 cannot make its payload of chunk 1
         {"version": 4, "fault": ("differs", 1, 0)},  # trainer rank 1's copy of chunk 0 is not the source's
         {"version": 5, "fault": ("node", 2, "node-a")},  # trainer rank 2 runs on node A, its engine rank on B
         {"version": 6}]


@pytest.mark.parametrize("buffered", [False, True], ids=["fresh-buckets", "transfer-buffer"])
def test_each_engine_rank_takes_the_payload_made_on_its_own_gpu_and_nothing_else(fake_sglang, model_dir, tmp_path,
                                                                                 buffered):
    """One run of the four ranks (spawning them is what costs): versions 1, 2 and 6 go in whole; 3, 4 and 5
    each meet one fault and are refused."""
    worker = start_head(model_dir)
    try:
        got = run_ranks(tmp_path, worker, STEPS, buffered=buffered)
        feed = worker.rank_feed()
        assert feed.slots == tuple(RankSlot(r, NODES[r], GPUS[r]) for r in range(WORLD)) and feed.spans_nodes
        pids = [got[r][0] for r in range(WORLD)]
        assert len(set(pids)) == WORLD and os.getpid() not in pids
        results = {step["version"]: [got[r][1][i] for r in range(WORLD)] for i, step in enumerate(STEPS)}

        # Whole versions: engine rank i opened the bucket trainer rank i made, on its own node, every chunk.
        n_chunks = len(adapter(1))
        records = loads(fake_sglang)
        assert len(records) == 3 * n_chunks + 1  # versions 1, 2, 6, and chunk 0 of version 3 (dropped again)
        for d in records:
            assert d["payload_pids"] == pids
            assert [NODES[pids.index(p)] for p in d["payload_pids"]] == [s.node for s in feed.slots]
        assert [(d["first"], d["last"]) for d in records[:n_chunks]] == [
            (k == 0, k == n_chunks - 1) for k in range(n_chunks)]
        # Every rank digested its own copy and got the engine's ack; the engine reports the trainer's digests.
        for v in (1, 2, 6):
            want = [chunk_digest(c.tensors) for c in adapter(v)]
            assert all(x["ok"] and x["digests"] == want and x["active"] == v for x in results[v]), v

        # Faulty versions: every rank raises the engine's one refusal, which names the engine, the engine rank,
        # the trainer rank, its node and GPU, and the chunk; the engine then serves no adapter (the old one went
        # before the first chunk of the new one, as the recipe orders it).
        errors = {v: {x.get("error") for x in results[v]} for v in (3, 4, 5)}
        assert all(len(e) == 1 for e in errors.values()), errors
        (e3,), (e4,), (e5,) = errors[3], errors[4], errors[5]
        for e in (e3, e4, e5):
            assert e.startswith(f"{HandoffRejected.__name__}: receiver rejected chunk "), e
            assert "the engine now serves the base model" in e, e
        assert ("receiver rejected chunk 1 of version 3: loading adapter version 3 failed: RankFeedError: engine 0 "
                "rank 3 (trainer rank 3, node node-b, GPU 1): trainer rank 3 on node node-b made no payload of chunk 1 "
                "of version 3: RuntimeError: the rank's device ran out of memory making its bucket") in e3
        assert ("engine 0 rank 1 (trainer rank 1, node node-a, GPU 1): trainer rank 1's copy of chunk 0 of version 4 "
                "differs from the source's") in e4
        assert ("engine 0 rank 2 (trainer rank 2, node node-b, GPU 0): its payload of chunk 0 of version 5 was made "
                "on node node-a; a CUDA IPC handle opens only on its own node") in e5
        # Nothing of versions 3-5 was announced or servable, and version 6 went in whole afterwards.
        versions = [d["new_version"] for _, c, d in fake_sglang.TIMELINE if c == "update_weight_version"]
        assert versions == ["1", "2", "0", "0", "0", "6"]

        (engine,) = fake_sglang.ENGINES
        assert worker.adapter_version() == 6 and worker.error() is None
        assert engine.partial == {} and set(engine.adapters) == {"k3_lora"} and not engine.paused
        # SGLang holds the trained adapter bit for bit (the fake checked every rank's copy equals rank 0's).
        trained = {n: t for c in adapter(6) for n, t in c.tensors}
        held = engine.adapters["k3_lora"]
        assert set(held) == set(trained) and all(torch.equal(held[n], trained[n]) for n in trained)
        report = worker.adapter_report()
        assert report["version"] == 6 and [report["chunk_digests"][i] for i in range(n_chunks)] == results[6][0][
            "digests"]
    finally:
        worker.shutdown()


# ============================================================================ the placement
def test_engine_ranks_follow_the_trainer_ranks_on_their_gpus():
    cluster = [(f"10.0.1.{r // 4}", [str(3 - r % 4)]) for r in range(64)]  # 16 nodes x 4 GPUs, any GPU order
    plans = plan_engine_nodes(4, 16, cluster)
    slots = engine_rank_slots(plans[2])
    assert [s.rank for s in slots] == list(range(32, 48))
    assert [(s.node, s.gpu) for s in slots[4:8]] == [("10.0.1.9", g) for g in ("3", "2", "1", "0")]
    assert engine_rank_slots(plan_engine_nodes(1, 1, [("127.0.0.1", [])])[0]) == (RankSlot(0, "127.0.0.1", None),)

    # Ranks 0 and 2 on node a, 1 and 3 on node b: SGLang would put TP ranks 0, 1 on node a.
    interleaved = [("a", ["0"]), ("b", ["0"]), ("a", ["1"]), ("b", ["1"])]
    with pytest.raises(ValueError, match=r"engine 0's training ranks interleave over its nodes \(node a: ranks "
                                         r"\[0, 2\] on GPUs \[\['0'\], \['1'\]\]; node b: ranks \[1, 3\]"):
        plan_engine_nodes(1, 4, interleaved)


def test_the_heads_visible_gpus_must_be_its_engine_ranks(model_dir):
    from k3.rollout.sglang.worker import SGLangEngineWorker
    from k3.settings.worker import WorkerSpec

    spec = WorkerSpec(model_dir=str(model_dir), lora=lora())
    SGLangEngineWorker(spec, rank_slots=plan_slots(), visible_devices=("0", "1")).shutdown()
    with pytest.raises(ValueError, match=r"engine 0: the head's CUDA_VISIBLE_DEVICES \['1', '0'\] on node node-a "
                                         r"are not the GPUs \['0', '1'\] of its engine ranks 0..1"):
        SGLangEngineWorker(spec, rank_slots=plan_slots(), visible_devices=("1", "0"))
    with pytest.raises(ValueError, match="only the head"):
        SGLangEngineWorker(spec, node_rank=1, rank_slots=plan_slots())


def test_a_trainer_rank_must_run_where_its_engine_rank_runs():
    feed = RankFeed(3, tuple(RankSlot(12 + r, NODES[r], GPUS[r]) for r in range(WORLD)), lambda *a: (b"", None))
    check_member_placement(feed, 14, "node-b", "0")
    check_member_placement(feed, 14, "node-b", None)  # a CPU rank: the node is what counts
    with pytest.raises(RankFeedError, match=r"engine 3 rank 2 \(trainer rank 14, node node-b, GPU 0\) takes its "
                                            r"adapter payloads from trainer rank 14, which runs on node node-a GPU 0"):
        check_member_placement(feed, 14, "node-a", "0")
    with pytest.raises(RankFeedError, match="runs on node node-b GPU 1"):
        check_member_placement(feed, 14, "node-b", "1")
    with pytest.raises(RankFeedError, match=r"trainer rank 2 feeds no rank of engine 3 \(its feeders are trainer "
                                            r"ranks \[12, 13, 14, 15\]\)"):
        check_member_placement(feed, 2, "node-a", "0")
    with pytest.raises(ValueError, match="each may feed one"):
        RankFeed(0, (RankSlot(0, "a", None), RankSlot(0, "a", None)), lambda *a: (b"", None))


def test_rank_payload_checks_name_what_does_not_fit():
    feed = RankFeed(1, tuple(RankSlot(r, NODES[r], GPUS[r]) for r in range(WORLD)), lambda *a: (b"", None))

    def payloads(**changes):
        ps = [RankPayload(r, NODES[r], GPUS[r], b"x", "d0") for r in range(WORLD)]
        for r, change in changes.items():
            ps[int(r[1:])] = dataclasses.replace(ps[int(r[1:])], **change)
        return RankPayloads(tuple(ps))

    assert check_rank_payloads(feed, 7, 3, payloads()) == []
    cpu = RankPayloads(tuple(RankPayload(r, NODES[r], None, b"x", "d0") for r in range(WORLD)))
    assert check_rank_payloads(feed, 7, 3, cpu) == []  # host memory: the node is what counts
    who = "engine 1 rank 2 (trainer rank 2, node node-b, GPU 0): "
    cases = {
        "r2": ({"data": None, "error": "OSError: no space"},
               who + "trainer rank 2 on node node-b made no payload of chunk 3 of version 7: OSError: no space"),
        "r2 ": ({"rank": 3}, who + "its payload of chunk 3 of version 7 was made by trainer rank 3 (node node-b, "
                                  "GPU 0), not by the trainer rank on its GPU"),
    }
    for key, (change, message) in cases.items():
        assert check_rank_payloads(feed, 7, 3, payloads(**{key.strip(): change})) == [message]
    assert check_rank_payloads(feed, 7, 3, payloads(r2={"node": "node-a"})) == [
        who + "its payload of chunk 3 of version 7 was made on node node-a; a CUDA IPC handle opens only on its "
              "own node"]
    assert check_rank_payloads(feed, 7, 3, payloads(r2={"gpu": "1"})) == [
        who + "its payload of chunk 3 of version 7 lies on GPU 1 of node node-b, not on the engine rank's GPU"]
    assert check_rank_payloads(feed, 7, 3, payloads(r2={"digest": "e1"})) == [
        who + "trainer rank 2's copy of chunk 3 of version 7 differs from the source's (digest e1… vs d0…)"]
    assert check_rank_payloads(feed, 7, 3, RankPayloads(payloads().payloads[:3])) == [
        "engine 1: chunk 3 of version 7 came with 3 rank payloads; the engine has 4 ranks"]
    two = check_rank_payloads(feed, 7, 3, payloads(r1={"node": "node-b"}, r3={"digest": "x"}))
    assert len(two) == 2 and two[0].startswith("engine 1 rank 1 ") and two[1].startswith("engine 1 rank 3 ")


def test_this_gpu_is_the_physical_id(monkeypatch):
    assert this_gpu("cpu") is None and this_gpu(torch.device("meta")) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert this_gpu("cuda:1") == "7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert this_gpu("cuda:1") == "1"


# ============================================================================ the payload and the head
def test_a_rank_payload_is_the_bucket_itself_serialized(fake_sglang):
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import reconstruct

    from k3.rollout.sglang.payload import bucket_entries, tensor_checksums
    from k3.rollout.sglang.rank_payload import serialize_rank_payload
    from k3.transport.handoff import flatten_into

    named = [(c.tensors[0][0], c.tensors[0][1].bfloat16()) for c in adapter(1)[:3]]
    bucket = torch.empty(sum(t.numel() for _, t in named), dtype=torch.bfloat16).share_memory_()
    flatten_into(bucket, [t for _, t in named])
    names, shapes = [n for n, _ in named], [tuple(t.shape) for _, t in named]
    entries = bucket_entries(names, shapes, torch.bfloat16)
    assert entries[0].start == 0 and entries[-1].end == 2 * bucket.numel()
    data, checksums = serialize_rank_payload(bucket, names, shapes, with_checksums=True)
    assert checksums == tensor_checksums(named)
    payload = MultiprocessingSerializer.deserialize(data)
    flat = payload["flattened_tensor"]
    # No copy: the payload is the bucket's own memory, viewed as bytes.
    assert flat.dtype == torch.uint8 and flat.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
    back = reconstruct(flat, payload["metadata"])
    assert [n for n, _ in back] == names and all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named))
    assert serialize_rank_payload(bucket, names, shapes, with_checksums=False)[1] is None
    with pytest.raises(ValueError, match="need 2 bytes, the bucket holds"):
        serialize_rank_payload(bucket, names[:1], [(1,)], with_checksums=False)
    with pytest.raises(ValueError, match="1-D contiguous"):
        serialize_rank_payload(bucket.view(1, -1), names, shapes, with_checksums=False)


def test_the_heads_feed_plan(fake_sglang, model_dir):
    worker = start_head(model_dir, streamed=True)
    try:
        with pytest.raises(RuntimeError, match="not listening yet"):
            worker.rank_feed()
        worker.listen()
        feed = worker.rank_feed()
        assert feed.engine_index == 0 and feed.source_rank == 0 and not feed.checksums
        assert feed.make_payload.__module__ == "k3.rollout.sglang.rank_payload"  # travels by reference
    finally:
        worker.shutdown()
    fake_sglang.ENGINES.clear()

    # Upstream SGLang's whole mode builds one bucket per version on the head: it cannot feed other nodes.
    from k3.rollout.sglang.errors import SGLangError

    worker = start_head(model_dir, streamed=False)
    try:
        with pytest.raises(SGLangError, match=r"engine 0 spans nodes \['node-a', 'node-b'\], but its SGLang loads "
                                              r"adapters in 'whole' mode .* use the recipe's SGLang build"):
            worker.listen()
    finally:
        worker.shutdown()
    # On one node whole mode keeps the head's bucket (no feed).
    one_node = tuple(RankSlot(r, "node-a", str(r)) for r in range(WORLD))
    worker = start_head(model_dir, streamed=False, slots=one_node)
    try:
        worker.listen()
        assert worker.rank_feed() is None
    finally:
        worker.shutdown()


def test_a_spanning_engine_refuses_a_single_bucket_and_a_plain_receiver_refuses_payloads(fake_sglang, model_dir):
    from multiprocessing.connection import Client

    from k3.transport.handoff import AdapterProducer, AdapterReceiver, ChunkHeader

    worker = start_head(model_dir)
    try:
        path, key = worker.listen()
        producer = AdapterProducer(Client(path, family="AF_UNIX", authkey=key))
        with pytest.raises(HandoffRejected, match=r"engine 0 spans nodes \['node-a', 'node-b'\]: chunk 0 of version "
                                                  r"1 came as one bucket, whose CUDA IPC handle the ranks on other "
                                                  r"nodes cannot open"):
            producer.send_version(adapter(1))
        producer.close()
        assert worker.adapter_version() == 0 and not fake_sglang.ENGINES[0].paused
    finally:
        worker.shutdown()
    header = ChunkHeader(1, 0, True, True, ("a.lora_A.weight",), ((2,),), torch.float32)
    ack = AdapterReceiver().receive(header, RankPayloads(()))
    assert not ack.ok and "came as RankPayloads; this receiver takes one bucket per chunk" in ack.error


def test_connect_engines_joins_the_feeds_after_connecting():
    from k3.rl.engines import connect_engines
    from k3.rl.errors import TrainingError

    feeds = [RankFeed(k, tuple(RankSlot(2 * k + r, "n", None) for r in range(2)), lambda *a: (b"", None))
             for k in range(2)]

    class Group:
        world_size = 4

        def __init__(self):
            self.calls = []

        def call_each(self, calls):
            self.calls.append(("each", list(calls)))

        def call(self, method, *args):
            self.calls.append((method, args))

    class Engine:
        def __init__(self, k, feed):
            self.k, self.feed = k, feed

        def has(self, method):
            return method == "rank_feed"

        def call(self, method):
            return (f"/sock{self.k}", b"key") if method == "listen" else self.feed

    group = Group()
    connect_engines(group, [Engine(k, feeds[k]) for k in range(2)], ranks_per_engine=2)
    assert group.calls == [("each", [("connect", ("/sock0", b"key")), ("export_only", ()),
                                     ("connect", ("/sock1", b"key")), ("export_only", ())]),
                           ("join_rank_feeds", (feeds,))]
    group = Group()
    connect_engines(group, [Engine(0, None), Engine(1, None)], ranks_per_engine=2)  # nothing to join
    assert [c[0] for c in group.calls] == ["each"]
    with pytest.raises(TrainingError, match="engine 1 would be fed from trainer rank 2, but trainer rank 1 is"):
        connect_engines(Group(), [Engine(0, None), Engine(1, feeds[1])], ranks_per_engine=1)


def test_joining_feeds_without_a_process_group_and_bad_feeds():
    from k3.transport.fed_producer import FedProducer
    from k3.transport.feed_group import FeedGroup, join_feeds

    maker = lambda *a: (b"", None)  # noqa: E731
    one = RankFeed(0, (RankSlot(0, "n", None),), maker)
    group = join_feeds([one], 0, "n", None)  # a feed of one rank: no group, no process group needed
    assert group.is_source and group.size == 1 and group.gather("p") == ["p"] and group.share("a") == "a"
    assert join_feeds([one], 1, "n", None) is None  # a rank that feeds no engine
    with pytest.raises(RankFeedError, match=r"engine 0 rank 0 \(trainer rank 0, node n, GPU None\) takes its adapter "
                                            r"payloads from trainer rank 0, which runs on node m"):
        join_feeds([one], 0, "m", None)
    two = RankFeed(1, (RankSlot(2, "n", None), RankSlot(3, "n", None)), maker)
    with pytest.raises(RankFeedError, match=r"engine 1 is fed by trainer ranks \[2, 3\], but this trainer has no "
                                            "process group"):
        join_feeds([two], 2, "n", None)
    with pytest.raises(RankFeedError, match="trainer rank 0 would feed both engine 0 and engine 2"):
        join_feeds([one, RankFeed(2, (RankSlot(0, "n", None),), maker)], 0, "n", None)
    with pytest.raises(ValueError, match="needs their Gloo group"):
        FeedGroup(two, 2, "n", None)
    # Only the source talks to the engine.
    with pytest.raises(ValueError, match="trainer rank 0 is its source and needs a connection to the engine"):
        FedProducer(None, group, chunk_digest)


# ============================================================================ one GPU: the feed over CUDA IPC
def _pickled_bucket(bucket, names, shapes, with_checksums):
    """A test ``make_payload`` without SGLang: the bucket itself, pickled as torch shares it (a CUDA IPC handle)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(bucket)
    return buf.getvalue(), None


class _PayloadOpener:
    """A receiver in another process that opens the one payload of each chunk and acks with its digest; a payload
    that does not say it lies on a GPU is refused."""

    def receive(self, header, payloads):
        import pickle

        from k3.transport.handoff import Ack, digest_tensors, unflatten

        (p,) = payloads.payloads
        if p.gpu is None:
            return Ack(header.version, header.index, ok=False, error="the payload does not lie on a GPU")
        bucket = pickle.loads(p.data)
        digest = digest_tensors([(n, t.clone()) for n, t in unflatten(bucket, header.names, header.shapes)])
        del bucket
        torch.cuda.synchronize()
        return Ack(header.version, header.index, ok=True, digest=digest)


def _make_payload_opener():
    return _PayloadOpener()


@pytest.mark.gpu
@pytest.mark.parametrize("buffered", [False, True], ids=["fresh-buckets", "transfer-buffer"])
def test_cuda_rank_payload_arrives_bit_exact_and_is_freed_after_the_ack(buffered):
    from k3.transport.fed_producer import FedProducer
    from k3.transport.feed_group import join_feeds
    from k3.transport.handoff import TransferBuffer, digest_tensors, spawn_receiver
    from k3.transport.rank_feed import this_node

    gpu = this_gpu("cuda:0")
    feed = RankFeed(0, (RankSlot(0, this_node(), gpu),), _pickled_bucket)
    group = join_feeds([feed], 0, this_node(), gpu)
    proc, conn = spawn_receiver(_make_payload_opener)
    producer = FedProducer(conn, group, chunk_digest, transfer_buffer=TransferBuffer("cuda:0") if buffered else None,
                           ack_timeout_s=120)
    try:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        for version in (1, 2, 3):
            chunks = [AdapterChunk([(n, t.to("cuda:0", torch.bfloat16)) for n, t in c.tensors], c.version,
                                   c.is_first, c.is_last, config=c.config) for c in adapter(version)]
            want = [digest_tensors(c.tensors) for c in chunks]
            got = []
            for index, c in enumerate(chunks):
                got.append(producer.send_chunk(c, index).digest)
            del c
            assert got == want and producer.version_digests == [chunk_digest(c.tensors) for c in chunks]
            del chunks
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - baseline
            # Fresh buckets are freed after each ack; the transfer buffer stays (the largest chunk).
            largest = max(sum(t.numel() for _, t in c.tensors) for c in adapter(1)) * 2
            assert held == 0 if not buffered else 0 < held <= 2 * largest + 2**20, held
    finally:
        producer.close()
        proc.join(timeout=60)


def test_the_feed_groups_take_the_runs_distributed_timeout():
    from types import SimpleNamespace

    from k3.rl.trainer_worker import _feed_group_timeout
    from k3.settings.worker import WorkerSpec

    assert _feed_group_timeout(WorkerSpec(model_dir="m", lora=lora())) == timedelta(minutes=10)  # the default
    assert _feed_group_timeout(WorkerSpec(model_dir="m", lora=lora(), distributed_timeout_minutes=0.5)) == \
        timedelta(seconds=30)
    assert _feed_group_timeout(SimpleNamespace(distributed_timeout_minutes=45)) == timedelta(minutes=45)
