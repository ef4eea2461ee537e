"""The SGLang engine's pure parts on CPU, without sglang: the flattened-bucket payload and its inverse, the
server arguments of a run, the sampling dicts, the mapping of SGLang results to samples, and the order of
SGLang calls for adapter loads and memory release/resume (against a recording stand-in for the binding)."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass

import pytest
import torch

from k3.launch.args import resolve
from k3.launch.parser import parse_train_args
from k3.lora.export import AdapterChunk
from k3.rollout.errors import AdapterVersionError, EngineStateError
from k3.rollout.protocol import GenerateRequest, SamplingParams
from k3.rollout.sglang.engine import LORA_NAME, SGLangEngine
from k3.rollout.sglang.errors import SGLangError, SGLangUnavailableError
from k3.rollout.sglang.payload import BucketEntry, build_lora_payload, sglang_bucket_payload, unflatten_lora_payload
from k3.rollout.sglang.results import sample_from_output
from k3.rollout.sglang.sampling import build_sampling_params
from k3.rollout.sglang.server_args import build_server_args, settings_from_dict
from k3.rollout.sglang.surface import CLUSTER_INSTALL_HINT, supports_streamed_lora_load

R, H = 4, 16
P = "language_model.model.layers."
PEFT = {"peft_type": "LORA", "r": R, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj",
                                                                          "down_proj"]}


def chunk(layer: int, version: int, first: bool, last: bool, seed: int = 0, config: dict | None = None):
    g = torch.Generator().manual_seed(seed * 100 + layer)
    tensors = [
        (f"{P}{layer}.self_attn.o_proj.lora_A.weight", torch.randn(R, 24, generator=g).bfloat16()),
        (f"{P}{layer}.self_attn.o_proj.lora_B.weight", torch.randn(H, R, generator=g).bfloat16()),
    ]
    return AdapterChunk(tensors, version, is_first=first, is_last=last, config=dict(config or PEFT))


def version_chunks(version: int, n: int = 3, seed: int = 0) -> list[AdapterChunk]:
    return [chunk(i, version, i == 0, i == n - 1, seed) for i in range(n)]


# ============================================================================ payload
def test_payload_layout_is_bytes_back_to_back():
    tensors = [("a.lora_A.weight", torch.zeros(R, H, dtype=torch.bfloat16)),
               ("b.lora_B.weight", torch.zeros(1, H, R, dtype=torch.bfloat16)),
               ("c.lora_A.weight", torch.zeros(3, dtype=torch.bfloat16))]
    flat, entries = build_lora_payload(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == 2 * (R * H + H * R + 3)
    assert [(e.name, e.shape, e.dtype, e.start, e.end) for e in entries] == [
        ("a.lora_A.weight", (R, H), torch.bfloat16, 0, 128),
        ("b.lora_B.weight", (1, H, R), torch.bfloat16, 128, 256),
        ("c.lora_A.weight", (3,), torch.bfloat16, 256, 262),
    ]
    assert [e.nbytes for e in entries] == [128, 128, 6]


def test_payload_inverse_is_exact_with_mixed_dtypes_and_padding():
    g = torch.Generator().manual_seed(1)
    tensors = [("x.lora_A.weight", torch.randn(3, generator=g).bfloat16()),   # 6 bytes: next fp32 needs 2 of pad
               ("y.lora_B.weight", torch.randn(2, 5, generator=g)),
               ("z.lora_A.weight", torch.randn(1, 4, 3, generator=g).half())]
    flat, entries = build_lora_payload(tensors)
    assert [(e.start, e.end) for e in entries] == [(0, 6), (8, 48), (48, 72)]
    assert flat[6:8].tolist() == [0, 0]
    back = unflatten_lora_payload(flat, entries)
    assert [n for n, _ in back] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.uint8 else got, want)
        # bit-identical, not just equal (NaN payloads, signed zeros)
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_payload_of_an_exported_chunk_round_trips():
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import export_chunks
    from k3.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=4, alpha=8))
    for c in export_chunks(model, version=1):
        flat, entries = build_lora_payload(c)
        assert flat.numel() == c.nbytes  # all BF16: no padding
        back = unflatten_lora_payload(flat, entries)
        assert [n for n, _ in back] == c.names
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, c.tensors))


def test_payload_rejects_bad_chunks():
    ok = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no tensors"):
        build_lora_payload([])
    with pytest.raises(ValueError, match="repeat"):
        build_lora_payload([("a", ok), ("a", ok)])
    with pytest.raises(ValueError, match="floating point"):
        build_lora_payload([("a", torch.zeros(2, dtype=torch.int32))])
    with pytest.raises(TypeError, match="torch.Tensor"):
        build_lora_payload([("a", [1.0, 2.0])])
    with pytest.raises(ValueError, match="several devices"):
        build_lora_payload([("a", ok), ("b", torch.zeros(2, dtype=torch.bfloat16, device="meta"))])


def test_unflatten_rejects_entries_that_do_not_fit():
    flat, entries = build_lora_payload([("a", torch.zeros(4)), ("b", torch.zeros(2))])
    with pytest.raises(ValueError, match="1-D uint8"):
        unflatten_lora_payload(flat.view(torch.float32), entries)
    with pytest.raises(ValueError, match="do not fit"):  # overlapping
        unflatten_lora_payload(flat, [entries[0], BucketEntry("b", (2,), torch.float32, 8, 16)])
    with pytest.raises(ValueError, match="do not fit"):  # past the end
        unflatten_lora_payload(flat, [BucketEntry("a", (8,), torch.float32, 0, 32)])
    with pytest.raises(ValueError, match="do not fit"):  # size differs from the shape
        unflatten_lora_payload(flat, [BucketEntry("a", (3,), torch.float32, 0, 16)])


def test_sglang_bucket_payload_carries_sglang_metadata():
    @dataclass
    class Meta:  # the fields of SGLang's FlattenedTensorMetadata (the contract test checks the real class)
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    flat, entries = build_lora_payload([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(5))])
    payload = sglang_bucket_payload(flat, entries, Meta)
    assert payload["flattened_tensor"] is flat
    assert payload["metadata"] == [Meta("a", torch.Size([2, 3]), torch.bfloat16, 0, 12, 12),
                                   Meta("b", torch.Size([5]), torch.float32, 12, 32, 20)]


def test_streamed_loading_is_detected_from_the_request_fields():
    assert supports_streamed_lora_load(["lora_name", "is_first_chunk", "is_last_chunk"])
    assert not supports_streamed_lora_load(["lora_name", "config_dict", "serialized_named_tensors"])
    assert not supports_streamed_lora_load(["is_first_chunk"])


# ============================================================================ server args
def resolved(words: str):
    return resolve(parse_train_args(words.split(), environ={}))


def server_settings(words: str):
    """The settings ``build_server_args`` takes, of a resolved ``k3 train`` command line."""
    r = resolved(words)
    return r.settings.rollout, r.settings.lora, r.settings.colocate


FOUR_LAYER = ("--model-variant 4layer --backend megatron --rollout-engine sglang --task dapo-math --num-rollout 10 "
              "--hf-checkpoint /ckpt/4layer --ref-load /ckpt/dcp --data-dir /data --run-id t")
VALIDATED = ("--mode normal --model-variant full --task dapo-math --reward-model deepscaler --num-nodes 16 "
             "--num-gpus-per-node 4 --pipeline-parallel-size 8 --context-parallel-size 2 --rollout-tp-size 16 "
             "--rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64 --rollout-batch-size 8 "
             "--n-samples-per-prompt 8 --sglang-max-total-tokens 65536 --global-batch-size 64 "
             "--hf-checkpoint /models/native --rollout-engine sglang --backend megatron --run-id v")
HF_TARGETS = ["o_proj", "q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]


def test_server_args_of_the_4layer_smoke():
    assert build_server_args(*server_settings(FOUR_LAYER)) == {
        "model_path": "/ckpt/4layer", "trust_remote_code": True, "tp_size": 8, "ep_size": 8,
        "weight_version": "0", "enable_lora": True, "max_loras_per_batch": 1, "max_lora_rank": 16,
        "lora_target_modules": HF_TARGETS, "lora_backend": "triton", "lora_strict_loading": True,
        "experts_shared_outer_loras": True, "lora_use_virtual_experts": True, "enable_memory_saver": True,
        "enable_weights_cpu_backup": True, "max_running_requests": 16, "random_seed": 1234,
        "max_mamba_cache_size": 16, "cuda_graph_bs_decode": [1, 2, 4, 8, 16], "context_length": 8192,
        "mem_fraction_static": 0.7, "moe_runner_backend": "triton", "disable_shared_experts_fusion": True,
    }


def test_server_args_of_the_validated_full_launch():
    r = server_settings(VALIDATED)
    with pytest.raises(ValueError, match=r"TP 16 spans 4 nodes of 4 GPUs: pass dist_init_addr and node_rank"):
        build_server_args(*r)
    args = build_server_args(*r, dist_init_addr="10.0.0.1:5000", node_rank=2)
    expected = {
        "tp_size": 16, "ep_size": 1, "nnodes": 4, "node_rank": 2, "dist_init_addr": "10.0.0.1:5000",
        "max_lora_rank": 32, "max_running_requests": 8, "max_mamba_cache_size": 40,
        "cuda_graph_bs_decode": [1, 2, 4, 8], "max_total_tokens": 65536, "lora_use_virtual_experts": False,
        "moe_runner_backend": "marlin", "decode_attention_backend": "trtllm_mla",
        "mamba_radix_cache_strategy": "extra_buffer", "cuda_graph_backend_prefill": "disabled",
        "enable_weights_cpu_backup": True, "model_path": "/models/native",
    }
    assert {k: args[k] for k in expected} == expected
    # The full variant never overrides memory fraction or context length (normal mode).
    assert "mem_fraction_static" not in args and "context_length" not in args
    assert "disable_shared_experts_fusion" not in args


def test_server_args_follow_the_flags():
    r = server_settings(FOUR_LAYER + " --no-lora-base-cpu-backup --lora-rank 8 --sglang-max-total-tokens 4096 "
                        "--seed 7")
    args = build_server_args(*r)
    assert (args["enable_weights_cpu_backup"], args["max_lora_rank"], args["max_total_tokens"],
            args["random_seed"]) == (False, 8, 4096, 7)


def test_server_args_from_plain_keywords_and_overrides():
    args = build_server_args(*settings_from_dict({"hf_checkpoint": "/m", "model_variant": "tiny",
                                                  "rollout_num_gpus_per_engine": 1, "lora_rank": 4,
                                                  "target_modules": ["self_attention.o_proj"]}),
                             mem_fraction_static=0.5, enable_weights_cpu_backup=None, log_level="info")
    assert args["tp_size"] == 1 and args["ep_size"] == 1 and args["max_running_requests"] == 64
    assert args["lora_target_modules"] == ["o_proj"] and args["mem_fraction_static"] == 0.5
    assert "enable_weights_cpu_backup" not in args and args["log_level"] == "info"


@pytest.mark.parametrize("change, message", [
    ({"hf_checkpoint": None}, "'hf_checkpoint' is missing"),
    ({"model_variant": None}, "'model_variant' is missing"),
    ({"rollout_num_gpus_per_engine": 0}, "TP size"),
    ({"sglang_ep_size": 3}, "sglang_ep_size 3 must divide the engine's TP size 8"),
    ({"experts_shared_outer_loras": False}, "experts_shared_outer_loras must be True"),
    ({"offload_rollout": False}, "lora_base_cpu_backup needs offload_rollout"),
    ({"target_modules": ["mlp.bogus"]}, "target_modules: LoRA target 'mlp.bogus' is unknown"),
])
def test_server_args_errors_name_the_key(change, message):
    flat = {"hf_checkpoint": "/m", "model_variant": "4layer", "rollout_num_gpus_per_engine": 8, "lora_rank": 4,
            "target_modules": ["self_attention.o_proj"]}
    flat.update(change)
    with pytest.raises(ValueError, match=message):
        build_server_args(*settings_from_dict(flat))


def test_server_args_reject_other_inputs():
    with pytest.raises(TypeError, match="expected a mapping"):
        settings_from_dict(["hf_checkpoint"])


def test_server_args_of_a_resolved_config_read_back_equal_the_typed_ones(tmp_path):
    """A resolved_config.json read back (what a CI script has) gives the same server arguments as the run's own
    typed settings."""
    from k3.launch.resolved_config import read_resolved_config, write_resolved_config

    for words in (FOUR_LAYER, VALIDATED):
        r = resolved(words)
        write_resolved_config(r, tmp_path)
        flat = read_resolved_config(tmp_path)
        overrides = {"dist_init_addr": "10.0.0.1:5000", "node_rank": 1}
        assert build_server_args(*settings_from_dict(flat), **overrides) == build_server_args(
            r.settings.rollout, r.settings.lora, r.settings.colocate, **overrides)


# ============================================================================ sampling
def test_sampling_params_per_request():
    params = build_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, seed=3,
                                                  stop_token_ids=(9, 7)), 3, stop_token_ids=(2, 7))
    base = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "skip_special_tokens": False,
            "spaces_between_special_tokens": False, "no_stop_trim": True, "stop_token_ids": [2, 7, 9]}
    assert params == [{**base, "sampling_seed": 3}, {**base, "sampling_seed": 4}, {**base, "sampling_seed": 5}]
    plain = build_sampling_params(SamplingParams(temperature=0.0, max_new_tokens=2), 2)
    assert plain == [{"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 2, "skip_special_tokens": False,
                      "spaces_between_special_tokens": False, "no_stop_trim": True}] * 2
    assert build_sampling_params(SamplingParams(), 0) == []
    with pytest.raises(ValueError, match="num_requests"):
        build_sampling_params(SamplingParams(), -1)


# ============================================================================ results
def sglang_result(ids, logprobs, finish=None, version="3", text="abc"):
    """A result in the shape SGLang 0.5.23's tokenizer manager returns for return_logprob=True."""
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "id": "9f1c", "finish_reason": finish if finish is not None else {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": 4, "weight_version": version, "num_retractions": 0, "completion_tokens": len(ids),
            "cached_tokens": 0, "input_token_logprobs": [],
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)],
            "output_token_logprobs_length": len(ids),
        },
    }


def test_result_maps_to_a_sample():
    req = GenerateRequest([5, 6, 7, 8], meta={"prompt_index": 3})
    s = sample_from_output(sglang_result([11, 12, 2], [-0.5, -1.25, -0.125]), req, adapter_version=1)
    assert (s.prompt_ids, s.tokens, s.text, s.logprobs, s.finish_reason, s.adapter_version, s.meta) == (
        [5, 6, 7, 8], [11, 12, 2], "abc", [-0.5, -1.25, -0.125], "stop", 3, {"prompt_index": 3})
    s.meta["x"] = 1
    assert req.meta == {"prompt_index": 3}  # the sample's meta is a copy


def test_result_length_finish_text_fallback_and_version_fallback():
    out = sglang_result([1, 2], [-1.0, -2.0], finish={"type": "length", "length": 2}, version="default", text=None)
    s = sample_from_output(out, GenerateRequest([1]), adapter_version=4, decode=lambda ids: "+".join(map(str, ids)))
    assert (s.finish_reason, s.adapter_version, s.text) == ("length", 4, "1+2")
    assert sample_from_output(out, GenerateRequest([1]), adapter_version=4).text == ""


@pytest.mark.parametrize("edit, message", [
    (lambda o: o["meta_info"].update(finish_reason={"type": "abort", "message": "client went away"}),
     "aborted request 9f1c: client went away"),
    (lambda o: o["meta_info"].update(finish_reason=None), "not stop or length"),
    (lambda o: o["meta_info"].pop("output_token_logprobs"), "no output_token_logprobs"),
    (lambda o: o["meta_info"]["output_token_logprobs"].pop(), "2 logprobs for 3 tokens"),
    (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(0, (-0.1, 99, None)), "differ from output_ids"),
    (lambda o: o.pop("meta_info"), "expected keys output_ids and meta_info"),
])
def test_bad_results_raise(edit, message):
    out = sglang_result([11, 12, 2], [-0.5, -1.25, -0.125])
    edit(out)
    with pytest.raises(SGLangError, match=message):
        sample_from_output(out, GenerateRequest([1]), adapter_version=0)


# ============================================================================ the engine over a recording binding
class RecordingBackend:
    """Stands in for the SGLang binding: records every call, unflattens the buckets it is sent."""

    def __init__(self, streamed: bool = False, fail_on_load: int | None = None) -> None:
        self.supports_streamed_load = streamed
        self.fail_on_load = fail_on_load
        self.calls: list[tuple] = []
        self.received: list[list[tuple[str, torch.Tensor]]] = []
        self.loads = 0
        self.weight_version = "0"

    def generate(self, input_ids, sampling_params, lora_path):
        self.calls.append(("generate", lora_path))
        return [sglang_result([p[0] + 1, 2], [-0.5, -0.25], version=self.weight_version) for p in input_ids]

    def load_lora_bucket(self, name, config, flat, entries, stream_flags, checksums):
        self.loads += 1
        if self.fail_on_load == self.loads:
            raise SGLangError("out of host memory")
        self.calls.append(("load", name, stream_flags, checksums is not None))
        self.received.append([(n, t.clone()) for n, t in unflatten_lora_payload(flat, entries)])
        self.checksums = checksums

    def load_lora_payloads(self, name, config, per_rank, stream_flags, checksums):
        self.loads += 1
        if self.fail_on_load == self.loads:
            raise SGLangError("out of host memory")
        self.calls.append(("payloads", name, stream_flags, tuple(per_rank), checksums is not None))
        self.checksums = checksums

    def unload_lora(self, name):
        self.calls.append(("unload", name))

    def update_weight_version(self, version):
        self.calls.append(("weight_version", version))
        self.weight_version = version

    def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))

    def flush_cache(self):
        self.calls.append(("flush",))

    def release_memory(self, tags):
        self.calls.append(("release", tags))

    def resume_memory(self, tags):
        self.calls.append(("resume", tags))

    def ipc_collect(self):
        pass

    def shutdown(self):
        self.calls.append(("shutdown",))


SERVER_ARGS = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": HF_TARGETS,
               "enable_memory_saver": True, "enable_weights_cpu_backup": True}


def engine(backend: RecordingBackend, **kw) -> SGLangEngine:
    return SGLangEngine(dict(SERVER_ARGS, **kw.pop("server", {})), backend=backend, **kw)


def test_generate_routes_requests_to_the_loaded_adapter():
    b = RecordingBackend()
    e = engine(b)
    reqs = [GenerateRequest([5]), GenerateRequest([7])]
    out = e.generate(reqs, SamplingParams(temperature=0))
    assert [s.tokens for s in out] == [[6, 2], [8, 2]] and b.calls == [("generate", None)]
    e.load_adapter(version_chunks(1), 1)
    e.generate(reqs, SamplingParams())
    assert b.calls[-1] == ("generate", [LORA_NAME, LORA_NAME])
    assert e.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="empty prompt"):
        e.generate([GenerateRequest([])], SamplingParams())


def test_whole_mode_load_sequence_and_payload():
    b = RecordingBackend()
    e = engine(b)
    assert e.load_mode == "whole"
    chunks = version_chunks(1)
    e.load_adapter(chunks, 1)
    assert b.calls == [("pause", "retract"), ("flush",), ("load", LORA_NAME, None, False), ("weight_version", "1"),
                       ("continue",)]
    sent = b.received[0]
    assert [n for n, _ in sent] == [n for c in chunks for n in c.names]
    assert all(torch.equal(a, t) for (_, a), (_, t) in zip(sent, [x for c in chunks for x in c.tensors]))
    assert e.adapter_version() == 1 and not e.is_paused
    b.calls.clear()
    e.load_adapter(version_chunks(2, seed=1), 2)
    assert b.calls == [("pause", "retract"), ("flush",), ("unload", LORA_NAME), ("load", LORA_NAME, None, False),
                       ("weight_version", "2"), ("continue",)]
    assert e.adapter_version() == 2


def test_streamed_mode_sends_one_bucket_per_chunk_with_flags():
    b = RecordingBackend(streamed=True)
    e = engine(b)
    assert e.load_mode == "streamed"
    e.load_adapter(version_chunks(1), 1)
    e.load_adapter(version_chunks(2), 2)
    loads = [c for c in b.calls if c[0] in ("load", "unload", "weight_version")]
    assert loads == [("load", LORA_NAME, (True, False), False), ("load", LORA_NAME, (False, False), False),
                     ("load", LORA_NAME, (False, True), False), ("weight_version", "1"),
                     ("unload", LORA_NAME), ("load", LORA_NAME, (True, False), False),
                     ("load", LORA_NAME, (False, False), False), ("load", LORA_NAME, (False, True), False),
                     ("weight_version", "2")]
    assert [[n for n, _ in r] for r in b.received[:3]] == [c.names for c in version_chunks(1)]


def test_a_caller_pause_is_kept_until_the_caller_continues():
    b = RecordingBackend()
    e = engine(b)
    e.pause_generation()
    e.pause_generation()  # idempotent
    e.load_adapter(version_chunks(1), 1)
    assert e.is_paused and ("continue",) not in b.calls
    with pytest.raises(EngineStateError, match="paused"):
        e.generate([GenerateRequest([1])], SamplingParams())
    e.continue_generation()
    e.continue_generation()
    assert b.calls.count(("pause", "retract")) == 1 and b.calls.count(("continue",)) == 1
    with pytest.raises(ValueError, match="pause mode"):
        engine(RecordingBackend()).pause_generation("sleep")


def test_atomic_swap_unloads_the_old_version_after_the_new_one():
    b = RecordingBackend(streamed=True)
    e = engine(b, atomic_swap=True)
    e.load_adapter(version_chunks(1, n=1), 1)
    e.load_adapter(version_chunks(2, n=1), 2)
    loads = [c for c in b.calls if c[0] in ("load", "unload")]
    assert loads == [("load", "k3_lora_v1", (True, True), False), ("load", "k3_lora_v2", (True, True), False),
                     ("unload", "k3_lora_v1")]
    e.generate([GenerateRequest([1])], SamplingParams())
    assert b.calls[-1] == ("generate", ["k3_lora_v2"])


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("broken, message", [
    (lambda cs: cs[1:], "chunk 0 has is_first=False"),
    (lambda cs: [chunk(0, 3, True, False)], "chunk 0 carries version 3"),
    (lambda cs: [chunk(0, 2, True, False, config={**PEFT, "r": 16})], "r=16 exceeds the engine's max_lora_rank=8"),
    (lambda cs: [chunk(0, 2, True, False, config={**PEFT, "target_modules": ["lm_head"]})],
     r"targets \['lm_head'\] are not in the engine's lora_target_modules"),
    (lambda cs: [chunk(0, 2, True, False, config={"r": 4})], "needs peft_type LORA"),
    (lambda cs: [], "no chunks"),
])
def test_a_stream_rejected_before_sending_changes_nothing(streamed, broken, message):
    b = RecordingBackend(streamed=streamed)
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    with pytest.raises(AdapterVersionError, match=message):
        e.load_adapter(broken(version_chunks(2)), 2)
    assert e.adapter_version() == 1 and not e.is_paused
    assert [c for c in b.calls if c[0] in ("load", "unload", "weight_version")] == []
    e.generate([GenerateRequest([1])], SamplingParams())
    assert b.calls[-1] == ("generate", [LORA_NAME])


@pytest.mark.parametrize("broken, message", [
    (lambda cs: cs[:2], "without the chunk marked is_last"),
    (lambda cs: cs + [chunk(7, 2, False, True)], "arrives after the chunk marked is_last"),
    (lambda cs: [cs[0], chunk(0, 2, False, True)], "repeats"),
    (lambda cs: [cs[0], AdapterChunk([("layers.1.o_proj.weight", torch.zeros(2))], 2, False, True)],
     "not PEFT LoRA names"),
    (lambda cs: [cs[0], chunk(1, 2, False, True, config={**PEFT, "r": 2})], "another adapter config"),
])
def test_whole_mode_rejects_every_stream_error_before_sending(broken, message):
    b = RecordingBackend()
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    with pytest.raises(AdapterVersionError, match=message):
        e.load_adapter(broken(version_chunks(2)), 2)
    assert e.adapter_version() == 1 and [c for c in b.calls if c[0] in ("load", "unload")] == []


def test_streamed_mode_broken_part_way_leaves_the_base_model_and_says_so():
    b = RecordingBackend(streamed=True)
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    with pytest.raises(AdapterVersionError, match="without the chunk marked is_last.*serves the base model"):
        e.load_adapter(version_chunks(2)[:2], 2)
    assert e.adapter_version() == 0
    # The old version went before the first chunk; the half-sent one is unloaded again.
    assert [c for c in b.calls if c[0] in ("load", "unload")] == [
        ("unload", LORA_NAME), ("load", LORA_NAME, (True, False), False), ("load", LORA_NAME, (False, False), False),
        ("unload", LORA_NAME)]
    assert b.calls[-2] == ("weight_version", "0")  # SGLang must not keep reporting the unloaded version
    (s,) = e.generate([GenerateRequest([1])], SamplingParams())
    assert b.calls[-1] == ("generate", None) and s.adapter_version == 0
    e.load_adapter(version_chunks(2), 2)  # the same version can be sent again
    assert e.adapter_version() == 2
    assert e.generate([GenerateRequest([1])], SamplingParams())[0].adapter_version == 2


def test_an_sglang_failure_reports_the_state_left():
    b = RecordingBackend(fail_on_load=2)
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    with pytest.raises(SGLangError, match="out of host memory; the engine now serves the base model"):
        e.load_adapter(version_chunks(2), 2)
    assert e.adapter_version() == 0 and not e.is_paused
    assert e.generate([GenerateRequest([1])], SamplingParams())[0].adapter_version == 0

    b = RecordingBackend(streamed=True, fail_on_load=3)
    e = engine(b, atomic_swap=True)
    e.load_adapter(version_chunks(1, n=2), 1)
    with pytest.raises(SGLangError, match="out of host memory; the engine still serves version 1"):
        e.load_adapter(version_chunks(2, n=2), 2)
    assert e.adapter_version() == 1 and b.calls[-2:] == [("unload", "k3_lora_v2"), ("continue",)]


def test_version_must_be_newer_and_an_integer():
    e = engine(RecordingBackend())
    e.load_adapter(version_chunks(2), 2)
    for bad, message in [(2, "not newer"), (1, "not newer"), (True, "integer"), (0, "integer"), ("3", "integer")]:
        with pytest.raises(AdapterVersionError, match=message):
            e.load_adapter(version_chunks(3), bad)
    assert e.adapter_version() == 2


def test_checksums_are_the_sha256_of_each_tensor():
    b = RecordingBackend()
    e = engine(b, verify_checksums=True)
    chunks = [AdapterChunk([("a.lora_A.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3))], 1, True, True,
                           config=PEFT)]
    e.load_adapter(chunks, 1)
    want = hashlib.sha256(torch.arange(6, dtype=torch.float32).numpy().tobytes()).hexdigest()
    assert b.checksums == {"a.lora_A.weight": want}


def test_memory_release_and_resume():
    b = RecordingBackend()
    e = engine(b)
    e.release_memory(["kv_cache", "cuda_graph"])
    e.release_memory(["kv_cache"])  # already released: nothing to do
    assert b.calls == [("flush",), ("release", ["kv_cache", "cuda_graph"])]
    with pytest.raises(EngineStateError, match="released"):
        e.generate([GenerateRequest([1])], SamplingParams())
    e.release_memory(["weights"])
    with pytest.raises(EngineStateError, match="weights are released"):
        e.load_adapter(version_chunks(1), 1)
    e.resume_memory(["weights"])
    e.load_adapter(version_chunks(1), 1)  # with the KV cache still released, as in the recipe's update step
    e.resume_memory(["weights", "kv_cache", "cuda_graph"])  # weights are not released: skipped
    assert b.calls[-1] == ("resume", ["kv_cache", "cuda_graph"]) and e.released_tags() == []
    with pytest.raises(ValueError, match="unknown memory tags"):
        e.release_memory(["activations"])


def test_memory_release_refuses_what_the_server_cannot_do():
    e = engine(RecordingBackend(), server={"enable_weights_cpu_backup": False})
    with pytest.raises(EngineStateError, match="lose the base weights"):
        e.release_memory(["weights"])
    e.release_memory(["kv_cache"])
    e = engine(RecordingBackend(), server={"enable_memory_saver": False})
    with pytest.raises(EngineStateError, match="enable_memory_saver"):
        e.release_memory(["kv_cache"])


def test_tokenizer_eos_is_a_stop_token_and_shutdown_is_final():
    class Tok:
        eos_id = 2

    b = RecordingBackend()
    captured = {}
    original = b.generate

    def generate(input_ids, sampling_params, lora_path):
        captured["params"] = sampling_params
        return original(input_ids, sampling_params, lora_path)

    b.generate = generate
    e = engine(b, tokenizer=Tok())
    e.generate([GenerateRequest([1])], SamplingParams(stop_token_ids=(5,)))
    assert captured["params"][0]["stop_token_ids"] == [2, 5]
    e.shutdown()
    e.shutdown()
    assert b.calls.count(("shutdown",)) == 1
    with pytest.raises(EngineStateError, match="shut down"):
        e.generate([GenerateRequest([1])], SamplingParams())


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="load_mode"):
        engine(RecordingBackend(), load_mode="lazy")
    with pytest.raises(ValueError, match="pause_mode"):
        engine(RecordingBackend(), pause_mode="stop")
    with pytest.raises(ValueError, match="enable_lora"):
        SGLangEngine({"model_path": "/m"}, backend=RecordingBackend())
    with pytest.raises(SGLangError, match="is_first_chunk and is_last_chunk"):
        engine(RecordingBackend(streamed=False), load_mode="streamed")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_the_engine_says_how_to_install_it():
    with pytest.raises(SGLangUnavailableError) as e:
        SGLangEngine(build_server_args(*server_settings(FOUR_LAYER)))
    assert CLUSTER_INSTALL_HINT in str(e.value) and "0.5.23" in str(e.value)
    with pytest.raises(SGLangUnavailableError):
        SGLangEngine.from_settings(*server_settings(FOUR_LAYER))


# ============================================================================ chunk-by-chunk loading (the hand-off's path)
def test_chunk_by_chunk_loading_sends_each_chunk_on_arrival():
    b = RecordingBackend(streamed=True)
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    chunks = version_chunks(2)
    load = e.begin_adapter(2)
    assert b.calls == [("pause", "retract"), ("flush",)] and e.is_paused
    load.add(chunks[0])
    assert b.calls[2:] == [("unload", LORA_NAME), ("load", LORA_NAME, (True, False), False)]
    assert e.adapter_version() == 0  # the old version went first; the new one is not active yet
    with pytest.raises(EngineStateError, match="paused"):
        e.generate([GenerateRequest([1])], SamplingParams())
    with pytest.raises(EngineStateError, match="version 2 is still being loaded"):
        e.begin_adapter(3)
    load.add(chunks[1])
    load.add(chunks[2])
    assert ("weight_version", "2") not in b.calls  # announced only once the version is complete
    load.finish()
    assert b.calls[-2:] == [("weight_version", "2"), ("continue",)] and e.adapter_version() == 2
    assert load.chunks == 3 and not load.is_open
    with pytest.raises(EngineStateError, match="this load is closed"):
        load.add(chunks[0])

    # The same calls as load_adapter of the whole stream.
    b2 = RecordingBackend(streamed=True)
    e2 = engine(b2)
    e2.load_adapter(version_chunks(1), 1)
    e2.load_adapter(version_chunks(2), 2)
    b3 = RecordingBackend(streamed=True)
    e3 = engine(b3)
    for v in (1, 2):
        load = e3.begin_adapter(v)
        for c in version_chunks(v):
            load.add(c)
        load.finish()
    assert b2.calls == b3.calls


def test_whole_mode_chunk_by_chunk_sends_nothing_before_finish():
    b = RecordingBackend(streamed=False)
    e = engine(b)
    load = e.begin_adapter(1)
    for c in version_chunks(1):
        load.add(c)
    assert [c for c in b.calls if c[0] in ("load", "unload", "weight_version")] == []
    load.finish()
    assert b.calls[2:] == [("load", LORA_NAME, None, False), ("weight_version", "1"), ("continue",)]


@pytest.mark.parametrize("streamed", [False, True])
def test_an_aborted_version_is_dropped_and_never_active(streamed):
    b = RecordingBackend(streamed=streamed)
    e = engine(b)
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    load = e.begin_adapter(2)
    load.add(version_chunks(2)[0])
    error = load.abort(AdapterVersionError("the hand-off lost chunk 1"))
    assert isinstance(error, AdapterVersionError)
    if streamed:  # the old version went before the first chunk; the partial new one is unloaded again
        assert "the hand-off lost chunk 1; the engine now serves the base model" in str(error)
        assert [c for c in b.calls if c[0] in ("load", "unload", "weight_version")] == [
            ("unload", LORA_NAME), ("load", LORA_NAME, (True, False), False), ("unload", LORA_NAME),
            ("weight_version", "0")]
        assert e.adapter_version() == 0
    else:  # nothing was sent: the engine still serves version 1
        assert "the engine still serves version 1" in str(error)
        assert [c for c in b.calls if c[0] in ("load", "unload", "weight_version")] == []
        assert e.adapter_version() == 1
    assert not e.is_paused and b.calls[-1] == ("continue",)
    assert load.abort(error) is error  # aborting a closed load changes nothing
    with pytest.raises(EngineStateError, match="closed"):
        load.finish()
    e.load_adapter(version_chunks(2), 2)
    assert e.adapter_version() == 2


def test_begin_adapter_checks_like_load_adapter():
    e = engine(RecordingBackend())
    e.load_adapter(version_chunks(2), 2)
    for bad, message in [(2, "not newer"), (True, "integer"), (0, "integer")]:
        with pytest.raises(AdapterVersionError, match=message):
            e.begin_adapter(bad)
    e.release_memory(["weights"])
    with pytest.raises(EngineStateError, match="weights are released"):
        e.begin_adapter(3)
    assert not e.is_paused


# ============================================================================ per-rank payloads (an engine fed rank by rank)
def meta_chunk(c: AdapterChunk) -> AdapterChunk:
    """What the forwarder hands the engine for per-rank payloads: names, shapes and flags, no data."""
    return AdapterChunk([(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in c.tensors], c.version,
                        c.is_first, c.is_last, config=dict(c.config))


def test_per_rank_payloads_go_to_sglang_as_they_are_in_stream_order():
    b = RecordingBackend(streamed=True)
    e = engine(b, server={"tp_size": 2})
    e.load_adapter(version_chunks(1), 1)
    b.calls.clear()
    load = e.begin_adapter(2)
    chunks = version_chunks(2)
    for k, c in enumerate(chunks):
        load.add_payloads(meta_chunk(c), [f"r0c{k}".encode(), f"r1c{k}".encode()], f"digest{k}", None)
    load.finish()
    assert b.calls == [("pause", "retract"), ("flush",), ("unload", LORA_NAME),
                       ("payloads", LORA_NAME, (True, False), (b"r0c0", b"r1c0"), False),
                       ("payloads", LORA_NAME, (False, False), (b"r0c1", b"r1c1"), False),
                       ("payloads", LORA_NAME, (False, True), (b"r0c2", b"r1c2"), False),
                       ("weight_version", "2"), ("continue",)]
    # The report holds the digests the payloads came with (the trainer ranks' own, checked equal by the feed).
    assert e.adapter_version() == 2 and e.adapter_report()["chunk_digests"] == {0: "digest0", 1: "digest1",
                                                                                 2: "digest2"}


def test_per_rank_payloads_are_refused_where_they_cannot_be_loaded():
    chunks = version_chunks(1)
    # Whole mode makes one bucket per version on the head: it cannot take payloads made elsewhere.
    e = engine(RecordingBackend(streamed=False), server={"tp_size": 2})
    load = e.begin_adapter(1)
    with pytest.raises(SGLangError, match="per-rank payloads need the streamed load mode"):
        load.add_payloads(meta_chunk(chunks[0]), [b"a", b"b"], "d", None)
    assert not load.is_open and e.adapter_version() == 0 and not e.is_paused
    # One payload per engine rank, no more, no less; nothing is sent otherwise.
    b = RecordingBackend(streamed=True)
    e = engine(b, server={"tp_size": 2})
    with pytest.raises(SGLangError, match="chunk 0 came with 3 rank payloads for 2 engine ranks"):
        e.begin_adapter(1).add_payloads(meta_chunk(chunks[0]), [b"a", b"b", b"c"], "d", None)
    assert not any(c[0] == "payloads" for c in b.calls)
    # An engine that verifies checksums needs them with every chunk.
    e = engine(b, server={"tp_size": 2}, verify_checksums=True)
    with pytest.raises(SGLangError, match="came without tensor checksums"):
        e.begin_adapter(1).add_payloads(meta_chunk(chunks[0]), [b"a", b"b"], "d", None)
    load = e.begin_adapter(1)
    load.add_payloads(meta_chunk(chunks[0]), [b"a", b"b"], "d", {"x": "sha"})
    assert b.calls[-1][0] == "payloads" and b.checksums == {"x": "sha"}
    # The stream's own checks hold as for tensors: a second first chunk is refused and the partial version goes.
    with pytest.raises(AdapterVersionError, match="only the first chunk of a version is marked first"):
        load.add_payloads(meta_chunk(chunks[0]), [b"a", b"b"], "d", {"x": "sha"})
    assert b.calls[-3:] == [("unload", LORA_NAME), ("weight_version", "0"), ("continue",)]
    assert e.adapter_version() == 0 and not e.is_paused
