"""The reference Kimi-K3 text model in plain PyTorch: ``KimiK3ForCausalLM``.

Parameter names equal the HF checkpoint's after ``language_model.`` (architecture §3), so a state dict loads
by name; the only translations are A_log's stored padding (``KDAttention``) and the per-expert expert names
(``LatentExperts``), both done by the modules' state-dict hooks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import (
    TEXT_PREFIX,
    CheckpointError,
    ShardedWriter,
    load_state_dict,
    parse_size,
    read_weight_map,
)
from k3.checkpoint.native import is_native_mxfp4, load_native_state_dict
from k3.config import K3Config
from k3.model.attn_res import AttnResBank, attn_res_final, attn_res_layer
from k3.model.cache import K3Cache, KDALayerState, MLALayerState, StaticK3Cache, StaticMLALayerState
from k3.model.kda import CausalConv1d, KDAttention
from k3.model.mla import MLADecodeAttention, MLAttention, MLAWindow
from k3.model.mlp import DenseMLP
from k3.model.moe import LatentExperts, LatentMoE, Router
from k3.model.norm import GatedRMSNorm, RMSNorm
from k3.model.precision import is_float32_param

__all__ = ["KimiK3ForCausalLM", "KimiK3Model", "K3DecoderLayer", "INIT_STD"]

# Normal std of every linear / embedding weight in a random model (the usual initializer_range).
INIT_STD = 0.02


class K3DecoderLayer(nn.Module):
    """One layer: KDA or MLA attention, dense MLP (layers < first_k_dense_replace) or LatentMoE, wired by AttnRes."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.block_start = cfg.is_block_start(layer_idx)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attention_res_norm = RMSNorm(H, eps)
        self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
        self.mlp_res_norm = RMSNorm(H, eps)
        self.mlp_res_proj = nn.Linear(H, 1, bias=False)
        self.self_attn = KDAttention(cfg, layer_idx) if self.is_kda else MLAttention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = DenseMLP(H, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, partial: torch.Tensor, bank: AttnResBank, token_mask: torch.Tensor | None,
                key_mask: torch.Tensor | None,
                state: KDALayerState | MLALayerState | StaticMLALayerState | None = None,
                window: MLAWindow | None = None) -> torch.Tensor:
        """``partial [batch, seq, hidden]`` -> the next partial sum; ``bank`` is pushed at block starts.

        ``token_mask [batch, seq]`` and ``key_mask [batch, cached + seq]`` are False at padding (None: all
        real); ``state`` is this layer's entry of the cache; ``window`` (one token from a ``StaticK3Cache`` at its
        device position) sends an MLA layer down its absorbed decode path.
        """

        def attn(a: torch.Tensor) -> torch.Tensor:
            x = self.input_layernorm(a)
            if self.is_kda:
                return self.self_attn(x, token_mask=token_mask, state=state)
            if window is not None:
                return self.self_attn.decode_window(x, state, window)
            return self.self_attn(x, key_mask=key_mask, state=state)

        return attn_res_layer(
            bank, partial, block_start=self.block_start,
            attn_res=(self.self_attention_res_norm, self.self_attention_res_proj), attn=attn,
            mlp_res=(self.mlp_res_norm, self.mlp_res_proj),
            ffn=lambda m: self.ffn(self.post_attention_layernorm(m)),
        )


class KimiK3Model(nn.Module):
    """Embedding, the decoder layers, the final AttnRes mix and norm. Returns normed hidden states."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(H, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, cache: K3Cache | StaticK3Cache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [batch, seq]`` -> hidden ``[batch, seq, hidden]`` after the final norm.

        ``attention_mask [batch, cached + seq]`` (1 real, 0 pad; left padding only) or None (all real).
        With a ``cache`` the new tokens continue the cached ones and the cache is advanced.
        """
        cfg = self.config
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)} dtype {input_ids.dtype}: expected an "
                             "integer tensor [batch, seq]")
        b, s = input_ids.shape
        if not input_ids.is_meta and input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(f"input_ids: token ids span [{lo}, {hi}]: expected 0 <= id < vocab_size "
                                 f"({cfg.vocab_size})")
        if cache is not None:
            if cache.batch_size != b:
                raise ValueError(f"cache: made for batch {cache.batch_size}, got input_ids for batch {b}")
            if len(cache.layers) != len(self.layers):
                raise ValueError(f"cache: has {len(cache.layers)} layers, the model {len(self.layers)}")
            if isinstance(cache, StaticK3Cache) and cache.seen_tokens + s > cache.max_len:
                raise ValueError(f"cache: holds {cache.seen_tokens} of its max_len {cache.max_len} tokens, no room "
                                 f"for {s} more")
        past = cache.seen_tokens if cache is not None else 0
        if attention_mask is not None:
            attention_mask = attention_mask.to(input_ids.device)
        key_mask = _resolve_mask(attention_mask, cache, b, s)
        token_mask = key_mask[:, past:] if key_mask is not None else None

        h = self._layers(input_ids, cache, token_mask, key_mask)
        if cache is not None:
            cache.advance(s, key_mask)
        return h

    def _layers(self, input_ids: torch.Tensor, cache: K3Cache | StaticK3Cache | None,
                token_mask: torch.Tensor | None, key_mask: torch.Tensor | None,
                window: MLAWindow | None = None) -> torch.Tensor:
        """Embedding, every layer, the final mix and norm (inputs already checked)."""
        h = self.embed_tokens(input_ids)
        if token_mask is not None:
            h = h.masked_fill(~token_mask.unsqueeze(-1), 0.0)  # padding enters every layer as exact zeros
        bank = AttnResBank()
        for i, layer in enumerate(self.layers):
            state = cache.layers[i] if cache is not None else None
            h = layer(h, bank, token_mask, key_mask, state, window)
        h = attn_res_final(bank, h, self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(h)

    def decode_step(self, tokens: torch.Tensor, cache: StaticK3Cache,
                    mla_attention: MLADecodeAttention | None = None) -> torch.Tensor:
        """One new token per row -> hidden ``[batch, hidden]``, the cache advanced; no input check, no host sync.

        Args:
            tokens: ``[batch]`` int64, the tokens to append (every one real; the caller vouches for their range).
            cache: a ``StaticK3Cache`` with room for one more token.
            mla_attention: None: MLA runs the reference math over the host-known positions (the very operations
                of ``forward`` with a ``K3Cache``: same logits to the bit on CPU), and ``seen_tokens`` advances.
                Given: the absorbed form at the device-side ``cache.position`` over the whole ``max_len`` window
                (the key mask hides what is not written), so the step reads no host state and a CUDA graph can
                capture it; the host count is then the caller's to advance (``cache.note_device_step()``).
        """
        if not isinstance(cache, StaticK3Cache):
            raise TypeError(f"decode_step needs a StaticK3Cache, got {type(cache).__name__}")
        if tokens.dim() != 1 or tokens.shape[0] != cache.batch_size:
            raise ValueError(f"decode_step: tokens {tuple(tokens.shape)}: expected [batch] = [{cache.batch_size}]")
        ids = tokens[:, None]
        if mla_attention is not None:
            cache.key_mask.index_fill_(1, cache.position, True)
            window = MLAWindow(cache.position, cache.key_mask, mla_attention)
            h = self._layers(ids, cache, None, None, window)
            cache.position.add_(1)
            return h[:, 0]
        past = cache.seen_tokens
        # The same masks forward() would resolve: None while every token is real, else the bool key mask with
        # this step's (real) token, whose own token mask is all True.
        key_mask = cache.begin_host_step()
        token_mask = key_mask[:, past:] if key_mask is not None else None
        h = self._layers(ids, cache, token_mask, key_mask)
        cache.end_host_step()
        return h[:, 0]


def _resolve_mask(attention_mask: torch.Tensor | None, cache: K3Cache | None, b: int, s: int
                  ) -> torch.Tensor | None:
    """The bool mask over cached + new tokens, or None when every token is real. Validates left padding."""
    past = cache.seen_tokens if cache is not None else 0
    cached = cache.attention_mask if cache is not None else None
    if attention_mask is None:
        if cached is None:
            return None
        return torch.cat([cached, cached.new_ones(b, s)], dim=1)
    m = attention_mask
    if tuple(m.shape) != (b, past + s):
        raise ValueError(f"attention_mask: shape {tuple(m.shape)}: expected [batch, cached + new] = "
                         f"[{b}, {past} + {s}]")
    if m.dtype != torch.bool:
        if m.is_floating_point() or bool(((m != 0) & (m != 1)).any()):
            raise ValueError("attention_mask: expected 1 (real token) / 0 (padding) or bool values")
        m = m.bool()
    real_then_pad = (m[:, :-1] & ~m[:, 1:]).any(-1)
    if bool(real_then_pad.any()):
        rows = torch.nonzero(real_then_pad).flatten().tolist()
        raise ValueError(f"attention_mask: rows {rows} have padding after a real token: only left padding "
                         "is supported (pad at the start of each row)")
    if past:
        before = cached if cached is not None else m.new_ones(b, past)
        if not torch.equal(m[:, :past], before.to(m.device)):
            raise ValueError(f"attention_mask: its first {past} columns differ from the mask of the tokens "
                             "already in the cache")
    return None if bool(m.all()) else m


class KimiK3ForCausalLM(nn.Module):
    """Kimi-K3 text model with its LM head. ``KimiK3ForCausalLM(cfg)`` builds a random model (also under
    ``torch.device("meta")``); ``from_pretrained(path)`` loads a BF16 HF checkpoint."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiK3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_weights()
        if dtype is not None:
            self.to(dtype)  # the float32 parameters stay float32 (KeepsFloat32)

    # ---------------------------------------------------------------- forward / decoding
    def forward(self, input_ids: torch.Tensor, cache: K3Cache | None = None,
                attention_mask: torch.Tensor | None = None, return_hidden: bool = False):
        """``input_ids [batch, seq]`` -> logits ``[batch, seq, vocab]`` (model dtype), or
        ``(logits, hidden [batch, seq, hidden])`` with ``return_hidden``.

        ``attention_mask [batch, cached + seq]``: 1 real, 0 padding (left padding). With ``cache`` (from
        ``init_cache``) the tokens continue the cached sequence, one or several at a time.
        """
        hidden = self.model(input_ids, cache=cache, attention_mask=attention_mask)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    def init_cache(self, batch_size: int) -> K3Cache:
        """An empty decoding cache on the model's device (latents in the model dtype)."""
        p = self.model.embed_tokens.weight
        return K3Cache(self.config, batch_size, dtype=p.dtype, device=p.device)

    def init_static_cache(self, batch_size: int, max_len: int) -> StaticK3Cache:
        """An empty preallocated cache for ``max_len`` tokens per row (prompt + new) on the model's device."""
        p = self.model.embed_tokens.weight
        return StaticK3Cache(self.config, batch_size, max_len, dtype=p.dtype, device=p.device)

    def decode_step(self, tokens: torch.Tensor, cache: StaticK3Cache,
                    mla_attention: MLADecodeAttention | None = None) -> torch.Tensor:
        """``tokens [batch]`` -> next-token logits ``[batch, vocab]`` (model dtype); see ``KimiK3Model.decode_step``."""
        return self.lm_head(self.model.decode_step(tokens, cache, mla_attention))

    # ---------------------------------------------------------------- random init
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random weights at healthy scales; deterministic under ``torch.manual_seed`` (or ``seed``).

        Linear/embedding/expert weights ~ N(0, 0.02²); norms 1; conv weights U(±1/√kernel); A_log =
        log U(1, 16) and dt_bias = softplus⁻¹(dt), log dt ~ U(log 1e-3, log 1e-1) (fla's KDA init); router
        correction bias 0; every AttnRes pseudo-query 0, so each mix starts uniform (as the report does).
        """
        if seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self._init_weights()
        else:
            self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, CausalConv1d):
                bound = 1.0 / math.sqrt(module.kernel_size)
                nn.init.uniform_(module.weight, -bound, bound)
            elif isinstance(module, KDAttention):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
                dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
                dt = dt.clamp_min(1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, std=INIT_STD)
                nn.init.zeros_(module.e_score_correction_bias)
            elif isinstance(module, LatentExperts):
                for w in (module.w1, module.w2, module.w3):
                    nn.init.normal_(w, std=INIT_STD)
        for module in self.modules():
            if isinstance(module, K3DecoderLayer):
                nn.init.zeros_(module.self_attention_res_proj.weight)
                nn.init.zeros_(module.mlp_res_proj.weight)
        nn.init.zeros_(self.model.output_attn_res_proj.weight)

    # ---------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "KimiK3ForCausalLM":
        """Load an HF checkpoint directory (config.json + sharded safetensors with an index): BF16, or the native
        MXFP4 release, whose packed routed experts are decoded on load (on ``device``: the Triton decoder on CUDA,
        the codec on the CPU), bit-identical to loading its ``k3 convert mxfp4-to-bf16`` output.

        Builds the model on the meta device and assigns the checkpoint tensors (cast to ``dtype``; the F32
        tensors stay float32), so weights are held once. Refuses any name or shape mismatch, listing the names.
        The model's config carries no ``quantization_config``: what it holds is decoded.
        """
        path = Path(path)
        cfg = K3Config.from_json(path).replace(quantization_config=None)
        if is_native_mxfp4(read_weight_map(path)):
            tensors = load_native_state_dict(path, device=device)
        else:
            tensors = load_state_dict(path)
        with torch.device("meta"):
            model = cls(cfg, dtype=dtype)
        expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
        # A_log may also be stored unpadded, at num_heads (the module's own shape); the module slices either way.
        also_allowed = {name: (cfg.num_kda_heads,) for name in expected if name.endswith(".A_log")}
        _check_names_and_shapes(path, expected, tensors, also_allowed)
        for name in list(tensors):
            tensors[name] = tensors[name].to(device=device, dtype=expected[name][1])
        model.load_state_dict(tensors, strict=True, assign=True)
        return model

    def save_pretrained(self, path: str | Path, max_shard_size: str | int = "2GB",
                        dtype: torch.dtype | None = None) -> None:
        """Write the released layout: wrapper config.json (no quantization_config), ``language_model.``
        names, sharded safetensors + ``model.safetensors.index.json``. ``dtype`` (e.g. bfloat16) casts every
        tensor but the F32 ones; None keeps each parameter's dtype."""
        path = Path(path)
        writer = ShardedWriter(path, parse_size(max_shard_size))
        state = self.state_dict()
        for name, t in tqdm(state.items(), desc=f"saving {path.name}", unit="tensor", disable=None):
            target = torch.float32 if is_float32_param(name) else (dtype or t.dtype)
            # copy=True: expert tensors are views of the stacked weights, and safetensors refuses shared storage
            writer.add(TEXT_PREFIX + name, t.detach().to(device="cpu", dtype=target, copy=True))
        writer.close()
        config = self.config.replace(quantization_config=None).to_hf_dict()
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _check_names_and_shapes(path: Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                            tensors: dict[str, torch.Tensor], also_allowed: dict[str, tuple[int, ...]]) -> None:
    def listing(names: list[str]) -> str:
        head = ", ".join(names[:20])
        return head + (f", … ({len(names) - 20} more)" if len(names) > 20 else "")

    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listing(unexpected)}")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {expected[n][0]})" for n in sorted(set(expected) & set(tensors))
             if tuple(tensors[n].shape) not in (expected[n][0], also_allowed.get(n))]
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape: {listing(wrong)}")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json (names after '{TEXT_PREFIX}'): "
                              + "; ".join(problems))
