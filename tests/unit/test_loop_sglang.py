"""The loop on the SGLang engine, on CPU: the real ``k3 train`` code path (in process) drives the real
``k3.rollout.sglang`` package against a test-only ``sglang`` (tests/fake_sglang: SGLang's module paths and
signatures, the tiny K3 behind them).

* the exact SGLang call sequence of every sync, for both ``--colocate-memory-peak-device`` orders and both LoRA
  load modes (the recipe build's streamed chunks, upstream 0.5.23's one bucket), trainer sleep/wake included;
* the adapter arrives intact (the engine's log-probabilities are the trainer's);
* a partial version is never activated (the hand-off rejects it, SGLang drops what it got of it);
* the fake's signatures are the pinned wheel's (read with the contract test's own reader), so the sequence
  above is made of calls the real SGLang takes;
* the colocation step lists and the engine placement, without Ray.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import write_tiny_run_inputs

from k3.config import variant
from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.launch.train import main as train_main
from k3.lora import LoRAConfig
from k3.lora.export import AdapterChunk, chunk_layout
from k3.rl import colocate
from k3.rl import loop as loop_mod
from k3.rl.handles import LocalHandle
from k3.rl.trainer_worker import TrainerWorker
from k3.rollout.sglang.placement import EngineNode, plan_engine_nodes
from k3.rollout.sglang.worker import SGLangEngineWorker
from k3.settings.lora import target_names
from k3.settings.worker import WorkerSpec

FAKE = Path(__file__).resolve().parents[1] / "fake_sglang"
CONTRACT = Path(__file__).resolve().parent / "test_sglang_contract.py"


# ============================================================================ fixtures
# fake_sglang: tests/conftest.py
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("loop_sglang"))


def _argv(root: Path, run: Path, *extra: str) -> list[str]:
    return ["--mode", "normal", "--model-variant", "tiny", "--task", "arith", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--rollout-max-response-len", "6", "--eval-interval", "2", "--lr", "1e-3", "--save-interval", "1",
            "--hf-checkpoint", str(root / "base"), "--data-dir", str(root / "data"), "--run-dir", str(run),
            "--rollout-engine", "sglang", "--num-gpus-per-node", "1", "--no-ipc-unlink-shim",
            "--sglang-path", str(FAKE), *extra]


class RecordingTrainer(TrainerWorker):
    """The real trainer, with the recipe's memory-region calls (recorded, no memory moved) and its sync bracketed
    on the fake's timeline."""

    def __init__(self, *args, **kwargs):
        import sglang

        sglang.record("trainer", "init")
        super().__init__(*args, **kwargs)

    def sleep(self) -> None:
        import sglang

        sglang.record("trainer", "sleep")

    def wake_up(self) -> None:
        import sglang

        sglang.record("trainer", "wake_up")

    def offload_grad_buffer(self) -> None:
        import sglang

        sglang.record("trainer", "offload_grad_buffer")

    def clear_memory(self) -> None:
        import sglang

        sglang.record("trainer", "clear_memory")

    def update_weights(self, version: int):
        import sglang

        from k3.transport.fed_producer import FedProducer

        sglang.record("trainer", "update_weights", version=version, fed=isinstance(self._producer, FedProducer))
        out = super().update_weights(version)
        sglang.record("trainer", "update_weights_done", version=version)
        return out


def rendered(timeline) -> list[str]:
    """The timeline as short lines (the CUDA-IPC reduction patch, called per bucket, left out)."""
    out = []
    for source, call, d in timeline:
        if source == "patch_torch":
            continue
        if source == "trainer":
            out.append(f"trainer.{call}")
        elif call == "load_lora_adapter_from_tensors":
            out.append(f"load first={d['first']} last={d['last']}")
        elif call in ("release_memory_occupation", "resume_memory_occupation"):
            out.append(f"{call.split('_')[0]} {','.join(d['tags'])}")
        elif call == "update_weight_version":
            out.append(f"version {d['new_version']}")
        elif call == "unload_lora_adapter":
            out.append(f"unload {d['lora_name']}")
        elif call == "pause_generation":
            out.append(f"pause {d['mode']}")
        elif call == "generate":
            out.append(f"generate {d['lora_path']}")
        else:
            out.append(call)
    return out


def expected_timeline(peak: str, streamed: bool, n_chunks: int) -> list[str]:
    """What the recipe's order (§5.4, §4.5) makes of 2 rollouts with evals at 0 and after rollout 1."""
    kv, weights, all_tags = "kv_cache,cuda_graph", "weights", "weights,kv_cache,cuda_graph"

    def release(tags: str) -> list[str]:
        return ["flush_cache", f"release {tags}"]  # SGLang wants its cache flushed before a release

    def sync(version: int) -> list[str]:
        out = ["pause retract", "trainer.update_weights", "flush_cache"]
        if version > 1:
            out.append("unload k3_lora")  # the previous version goes before the first chunk of the new one
        if streamed:
            out += [f"load first={i == 0} last={i == n_chunks - 1}" for i in range(n_chunks)]
        else:
            out.append("load first=None last=None")
        # Generation continues only after the trainer returned (its sync cleanup done).
        return out + [f"version {version}", "trainer.update_weights_done", "continue_generation", f"resume {kv}"]

    if peak == "cpu":
        startup = [*release(all_tags), "trainer.init", "trainer.sleep", f"resume {weights}"]
        before_train = [*release(all_tags), "trainer.wake_up"]
        after_train = ["trainer.sleep", f"resume {weights}"]
    else:
        startup = [*release(kv), "trainer.init", "trainer.sleep"]
        before_train = [*release(kv), "trainer.wake_up", *release(weights)]
        after_train = ["trainer.clear_memory", "trainer.offload_grad_buffer", f"resume {weights}", "trainer.sleep"]
    rollout = ["generate ['k3_lora']", *before_train, *after_train]
    return ["Engine", *startup, *sync(1), "generate ['k3_lora']",  # eval@0
            *rollout, *sync(2), *rollout, *sync(3), "generate ['k3_lora']",  # eval after rollout 1
            "shutdown"]


# ============================================================================ the loop
@pytest.mark.parametrize("buffered", [False, True], ids=["fresh-buckets", "transfer-buffer"])
@pytest.mark.parametrize("streamed", [True, False], ids=["recipe-build-streamed", "upstream-whole"])
@pytest.mark.parametrize("peak", ["cpu", "gpu"])
def test_loop_drives_sglang_in_the_recipes_order(fake_sglang, tiny, monkeypatch, peak, streamed, buffered):
    """Also through the transfer buffer: the forwarder hands SGLang a copy of each chunk (streamed) or keeps a
    clone (whole) before the ack lets the trainer overwrite the buffer."""
    from sglang.srt.managers import io_struct

    io_struct.use_recipe_build(streamed)
    monkeypatch.setenv("K3_IN_PROCESS", "1")
    monkeypatch.setattr(loop_mod, "TrainerWorker", RecordingTrainer)
    from k3.transport.handoff import TransferBuffer

    claims = []
    real_claim = TransferBuffer.claim
    monkeypatch.setattr(TransferBuffer, "claim", lambda self, n: claims.append(n) or real_claim(self, n))
    run = tiny / f"run-{peak}-{streamed}-{buffered}"
    flags = ["--colocate-memory-peak-device", peak] + (["--lora-transfer-buffer"] if buffered else [])
    assert train_main(_argv(tiny, run, *flags)) == 0

    n_chunks = len(chunk_layout(variant("tiny"), LoRAConfig(rank=16, alpha=32)))
    assert len(claims) == (3 * n_chunks if buffered else 0)  # every chunk of the 3 versions through the buffer
    assert rendered(fake_sglang.TIMELINE) == expected_timeline(peak, streamed, n_chunks)
    # Streamed, the engine is fed rank by rank: its one rank's payload is the trainer's own bucket, serialized by
    # the trainer and passed to SGLang as it is. Whole, the head builds one bucket per version (one node only).
    fed = [d["fed"] for source, call, d in fake_sglang.TIMELINE if (source, call) == ("trainer", "update_weights")]
    assert fed == [streamed] * 3
    pids = [d["payload_pids"] for _, call, d in fake_sglang.TIMELINE if call == "load_lora_adapter_from_tensors"]
    assert pids and all(p == [os.getpid()] for p in pids)
    # Adapters change only while generation is paused, and never with the weights released.
    for _, call, d in fake_sglang.TIMELINE:
        if call in ("load_lora_adapter_from_tensors", "unload_lora_adapter", "update_weight_version"):
            assert d["paused"] and "weights" not in d["released"], (call, d)
    (engine,) = fake_sglang.ENGINES
    assert engine.server_args["max_loras_per_batch"] == 1 and engine.server_args["enable_weights_cpu_backup"]
    assert engine.closed and engine.weight_version == "3"

    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["status"] == "finished"
    syncs = [e for e in events if e["event"] == "sync"]
    assert [s["adapter/version"] for s in syncs] == [1, 2, 3] and all("leak" not in s for s in syncs)
    after = [e for e in events if e["event"] == "memory" and e["phase"] == "after_update_weights"]
    before = [e for e in events if e["event"] == "memory" and e["phase"] == "before_update_weights"]
    assert [(m["sync"], m["rank"]) for m in after] == [(0, 0), (1, 0), (2, 0)] == [(m["sync"], m["rank"])
                                                                                   for m in before]
    # The engine's log-probabilities are the trainer's to float32 rounding: the adapter arrived bit for bit.
    train = [e for e in events if e["event"] == "train"]
    assert len(train) == 2 and all(t["rollout/train_rollout_logprob_abs_diff"] < 1e-5 for t in train)
    rollouts = [e for e in events if e["event"] == "rollout"]
    assert [r["adapter_version"] for r in rollouts] == [1, 2]


def test_without_sglang_the_sglang_run_stops_at_once(tiny, tmp_path, capsys):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is importable here")
    argv = _argv(tiny, tmp_path / "run")
    argv[argv.index("--sglang-path") + 1] = str(tmp_path / "no-sglang")
    assert train_main(argv) == 2
    assert "has no sglang/ and sglang is not installed" in capsys.readouterr().err
    # run() itself (without k3 train's input check) refuses before Ray or any model starts.
    resolved = resolve(parse_train_args([*argv[:argv.index("--run-dir")], "--run-dir", str(tmp_path / "run2"),
                                         *argv[argv.index("--run-dir") + 2:]], environ={}))
    with pytest.raises(loop_mod.TrainingError, match=r"sglang==0\.5\.23.*not installed.*--rollout-engine embedded"):
        loop_mod.run(resolved.settings, in_process=True)
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


# ============================================================================ the hand-off: partial versions
def _worker(root: Path, rank: int = 4) -> tuple[SGLangEngineWorker, LoRAConfig]:
    from k3.rollout.sglang.server_args import build_server_args, settings_from_dict

    spec = WorkerSpec(model_dir=str(root / "base"), lora=LoRAConfig(rank=rank, alpha=2.0 * rank, dropout=0.0,
                                                                     target_modules=target_names()))
    worker = SGLangEngineWorker(spec, sglang_path=str(FAKE))
    worker.start(build_server_args(*settings_from_dict({"hf_checkpoint": str(root / "base"), "model_variant": "tiny",
                                                        "rollout_num_gpus_per_engine": 1, "lora_rank": rank,
                                                        "target_modules": list(target_names())})))
    return worker, spec.lora


def _version(lora: LoRAConfig, version: int, scale: float = 0.01) -> list[AdapterChunk]:
    layout = chunk_layout(variant("tiny"), lora)
    g = torch.Generator().manual_seed(version)
    out = []
    for k, c in enumerate(layout):
        made: dict[str, torch.Tensor] = {}
        tensors = []
        for name, shape in c.tensors:
            tied = made.get(name.replace(".up_proj.lora_A.", ".gate_proj.lora_A."))  # fc1's shared lora_A
            made[name] = tied if tied is not None else torch.randn(*shape, generator=g) * scale
            tensors.append((name, made[name]))
        out.append(AdapterChunk(tensors, version, k == 0, k == len(layout) - 1, config=lora.peft_config()))
    return out


@pytest.mark.parametrize("streamed", [True, False], ids=["recipe-build-streamed", "upstream-whole"])
def test_a_partial_version_is_never_activated(fake_sglang, tiny, streamed):
    from sglang.srt.managers import io_struct

    from k3.rollout.protocol import GenerateRequest, SamplingParams
    from k3.transport.handoff import AdapterProducer, HandoffRejected

    io_struct.use_recipe_build(streamed)
    worker, lora = _worker(tiny)
    (engine,) = fake_sglang.ENGINES
    path, key = worker.listen()
    producer = AdapterProducer(Client(path, family="AF_UNIX", authkey=key))
    try:
        producer.send_version(_version(lora, 1))
        assert worker.adapter_version() == 1 and set(engine.adapters) == {"k3_lora"}

        full = _version(lora, 2)
        broken = [full[0], *full[2:]]  # the second chunk is lost; the last one still says is_last
        with pytest.raises(HandoffRejected, match="ended with .* adapter tensors missing"):
            producer.send_version(broken)
        bad = [c for c in _version(lora, 2)]
        name, t = bad[1].tensors[0]
        bad[1].tensors[0] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))
        with pytest.raises(HandoffRejected, match="has shape"):
            producer.send_version(bad)
        # Neither broken stream was ever servable and no version 2 was announced. Streamed, the old version was
        # unloaded before the first chunk (the recipe's order) and what SGLang got of the new one was dropped
        # again: the base model serves. Whole, nothing was sent: version 1 still serves.
        served = 0 if streamed else 1
        assert worker.adapter_version() == served and engine.partial == {} and not engine.paused
        assert set(engine.adapters) == (set() if streamed else {"k3_lora"}) and engine.weight_version == str(served)
        versions = [d["new_version"] for _, c, d in fake_sglang.TIMELINE if c == "update_weight_version"]
        assert versions == (["1", "0", "0"] if streamed else ["1"])
        (s,) = worker.generate([GenerateRequest([5, 6, 7])], SamplingParams(temperature=0.0, max_new_tokens=3))
        assert s.adapter_version == served

        producer.send_version(_version(lora, 2))  # a complete version goes in afterwards
        assert worker.adapter_version() == 2 and worker.error() is None
        (s,) = worker.generate([GenerateRequest([5, 6, 7])], SamplingParams(temperature=0.0, max_new_tokens=3))
        assert s.adapter_version == 2
    finally:
        producer.close()
        worker.shutdown()


def test_every_sglang_call_runs_on_the_engine_thread(fake_sglang, tiny):
    """The fake raises on a call from another thread than its creator's; the hand-off's receiver thread and
    the caller's thread both go through the worker's engine thread."""
    import threading

    from k3.rollout.protocol import GenerateRequest, SamplingParams

    worker, _ = _worker(tiny)
    results = []
    t = threading.Thread(target=lambda: results.append(worker.generate([GenerateRequest([1, 2])],
                                                                       SamplingParams(max_new_tokens=2))))
    t.start()
    t.join(60)
    assert len(results) == 1 and len(results[0]) == 1
    worker.release_memory(["kv_cache", "cuda_graph"])
    worker.release_memory(["kv_cache"])  # idempotent: SGLang is not asked twice
    worker.resume_memory(["kv_cache", "cuda_graph", "weights"])  # weights were never released: skipped
    calls = [c for _, c, _ in fake_sglang.TIMELINE if c.endswith("memory_occupation")]
    assert calls == ["release_memory_occupation", "resume_memory_occupation"]
    worker.shutdown()


# ============================================================================ the fake is the pinned SGLang
def _contract():
    spec = importlib.util.spec_from_file_location("_k3_sglang_contract", CONTRACT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_object(use):
    """The fake's counterpart of one SGLANG_SURFACE entry."""
    module = importlib.import_module(use.module[:-3].replace("/", "."))
    obj = module
    for part in use.target.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_fake_has_the_pinned_sglangs_signatures(fake_sglang):
    import ast
    import dataclasses

    import k3.rollout.sglang.surface as sgl

    contract = _contract()
    src = contract.Source(contract._fetch_wheel())  # the contract test's own reader (skips offline)
    checked = 0
    for use in sgl.SGLANG_SURFACE:
        if use.kind in ("method", "async_method", "function"):
            if use.kind == "function":
                real = next(n for n in src.tree(use.module).body
                            if isinstance(n, ast.FunctionDef) and n.name == use.target)
            else:
                real = src.method(use.module, use.target)
            args = real.args
            real_names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            if use.kind != "function" and not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                                  for d in real.decorator_list):
                real_names = real_names[1:]
            fake = _fake_object(use)
            names = list(inspect.signature(fake).parameters)
            assert (names[1:] if names[:1] == ["self"] else names) == real_names, use.target
            assert inspect.iscoroutinefunction(fake) == (use.kind == "async_method"), use.target
            checked += 1
        elif use.kind == "struct":
            real = set(src.fields(use.module, use.target))
            fake = {f.name for f in dataclasses.fields(_fake_object(use))}
            extra = set(sgl.STREAMED_LOAD_FIELDS) if use.target == "LoadLoRAAdapterFromTensorsReqInput" else set()
            assert fake == real | extra, use.target
            checked += 1
    assert checked == sum(u.kind in ("method", "async_method", "function", "struct") for u in sgl.SGLANG_SURFACE)


# ============================================================================ pure parts
def test_colocation_steps_are_the_recipes_orders():
    E, T = colocate.ENGINES, colocate.TRAINER
    levels = ["kv_cache", "weight"]

    def plain(steps):
        return [(s.target, s.method, s.tags) for s in steps]

    assert plain(colocate.startup_steps("cpu", levels)) == [(E, "release_memory", ("kv_cache", "cuda_graph",
                                                                                    "weights"))]
    assert plain(colocate.startup_steps("gpu", levels)) == [(E, "release_memory", ("kv_cache", "cuda_graph"))]
    assert plain(colocate.before_first_sync_steps("cpu", levels)) == [(T, "sleep", ()),
                                                                       (E, "resume_memory", ("weights",))]
    assert plain(colocate.before_first_sync_steps("gpu", levels)) == [(T, "sleep", ())]
    assert plain(colocate.before_train_steps("gpu", levels)) == [
        (E, "release_memory", ("kv_cache", "cuda_graph")), (T, "wake_up", ()), (E, "release_memory", ("weights",))]
    assert plain(colocate.after_train_steps("gpu", levels)) == [
        (T, "clear_memory", ()), (T, "offload_grad_buffer", ()), (E, "resume_memory", ("weights",)), (T, "sleep", ())]
    assert plain(colocate.after_train_steps("cpu", levels)) == [(T, "sleep", ()), (E, "resume_memory", ("weights",))]
    # Without 'weight' in --offload-rollout-level the engine weights never move.
    assert plain(colocate.before_train_steps("gpu", ["kv_cache"])) == [
        (E, "release_memory", ("kv_cache", "cuda_graph")), (T, "wake_up", ())]
    assert plain(colocate.after_train_steps("cpu", ["kv_cache"])) == [(T, "sleep", ())]
    # Without --offload-train the trainer keeps its memory resident: only the engine steps remain, in order.
    for peak in ("cpu", "gpu"):
        for steps in (colocate.before_train_steps, colocate.after_train_steps):
            assert plain(steps(peak, levels, offload_train=False)) == [
                s for s in plain(steps(peak, levels)) if s[0] == E]
    assert colocate.before_first_sync_steps("gpu", levels, offload_train=False) == []
    # An engine that gave nothing up at start gets nothing back before the startup sync.
    assert plain(colocate.before_first_sync_steps("cpu", levels, engines_released=False)) == [(T, "sleep", ())]
    with pytest.raises(ValueError, match="colocate_memory_peak_device='disk'"):
        colocate.before_train_steps("disk", levels)


def test_engine_nodes_of_the_4layer_and_full_layouts():
    one_node = [("10.0.0.1", [str(g)]) for g in range(8)]
    (nodes,) = plan_engine_nodes(1, 8, one_node)
    assert nodes == [EngineNode(0, 0, "10.0.0.1", 0, tuple(range(8)), tuple(str(g) for g in range(8)))]

    # 16 nodes × 4 GPUs, 4 engines of TP16: each engine takes 4 whole nodes, node rank = node order.
    cluster = [(f"10.0.1.{r // 4}", [str(3 - r % 4)]) for r in range(64)]  # Ray may hand out GPU ids in any order
    plans = plan_engine_nodes(4, 16, cluster)
    assert [len(p) for p in plans] == [4, 4, 4, 4]
    head = plans[2][0]
    assert (head.engine_index, head.node_rank, head.node_ip, head.bundle_rank) == (2, 0, "10.0.1.8", 32)
    assert plans[2][3].ranks == (44, 45, 46, 47) and plans[2][3].visible_devices == ("3", "2", "1", "0")

    cpu = [("127.0.0.1", [])]
    assert plan_engine_nodes(1, 1, cpu)[0][0].visible_devices is None
    with pytest.raises(ValueError, match="need 16 GPU bundles; the placement has 8"):
        plan_engine_nodes(2, 8, one_node)
    uneven = [("a", ["0"])] * 3 + [("b", ["0"])]
    with pytest.raises(ValueError, match="spans its nodes unevenly"):
        plan_engine_nodes(1, 4, uneven)


def test_generation_is_sharded_over_engines_in_order():
    from k3.rollout.protocol import GenerateRequest, SamplingParams

    class Engine:
        def __init__(self, k):
            self.k, self.calls = k, []

        def generate(self, reqs, sampling):
            self.calls.append((len(reqs), sampling.seed))
            return [(self.k, r.meta["i"]) for r in reqs]

    engines = [Engine(k) for k in range(3)]
    loop = object.__new__(loop_mod.Loop)
    loop.engines = [LocalHandle(e) for e in engines]
    loop.engine = loop.engines[0]
    reqs = [GenerateRequest([1], {"i": i}) for i in range(8)]
    out = loop._generate(reqs, SamplingParams(seed=100))
    assert [i for _, i in out] == list(range(8)) and [k for k, _ in out] == [0, 0, 1, 1, 1, 2, 2, 2]
    assert [e.calls for e in engines] == [[(2, 100)], [(3, 102)], [(3, 105)]]  # request i samples with seed + i


def test_update_weights_results_of_every_rank_are_kept():
    assert loop_mod._rank_results({"a": 1}) == [{"a": 1}]
    assert loop_mod._rank_results([{"a": 1}, {"a": 2}]) == [{"a": 1}, {"a": 2}]
    with pytest.raises(loop_mod.TrainingError, match="no result"):
        loop_mod._rank_results([])


def test_loop_drives_sglang_engines_as_ray_actors(tiny, monkeypatch):
    """The Ray path: engines placed by probing the bundles (a GPU resource faked on this CPU machine), started
    as actors, driven through actor handles, shut down at the end; the run's result is the in-process one's."""
    ray = pytest.importorskip("ray")
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("a real sglang is installed here; this test drives the fake one")
    monkeypatch.delenv("K3_IN_PROCESS", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the driver's --sglang-path insert is undone afterwards
    repo = Path(__file__).resolve().parents[2]
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{FAKE}:{repo}", "OMP_NUM_THREADS": "1"}})
    try:
        run = tiny / "run-ray"
        assert train_main(_argv(tiny, run)) == 0
    finally:
        ray.shutdown()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["status"] == "finished"
    assert [e["adapter/version"] for e in events if e["event"] == "sync"] == [1, 2, 3]
    train = [e for e in events if e["event"] == "train"]
    assert len(train) == 2 and all(t["rollout/train_rollout_logprob_abs_diff"] < 1e-5 for t in train)
