"""What incremental decoding carries between calls, in two forms.

``K3Cache`` (the plain reference, grown per call): per KDA layer the recurrent state ``[batch, heads, K, V]``
(float32) and the last ``conv_kernel − 1`` inputs of the q/k/v short convolutions ``[batch, proj, conv_kernel − 1]``
(float32, the conv weights' dtype); per MLA layer the ``kv_lora_rank + qk_rope_head_dim`` latent of every token
seen (576 for K3, model dtype), concatenated per call; and, for the whole model, how many tokens were seen and the
attention mask so far. AttnRes needs nothing here: it mixes over depth, one token at a time.

``StaticK3Cache`` (decoding without allocation): the same state preallocated for ``max_len`` tokens and written in
place — the KDA states copied into, the MLA latent split into its two parts ``ckv [batch, max_len, kv_lora_rank]``
(stored *after* ``kv_a_layernorm``, what the absorbed decode kernels read) and ``kpe [batch, max_len, rope]``, the
key mask ``[batch, max_len]`` (False at padding and at positions not written yet), and the next position both as a
host int (``seen_tokens``) and as a device tensor (``position``, what a captured CUDA graph reads). Rows keep the
left-padded columns of the batch, so a prefill and every step land at the same columns as in ``K3Cache``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config

__all__ = ["K3Cache", "KDALayerState", "MLALayerState", "StaticK3Cache", "StaticKDALayerState",
           "StaticMLALayerState"]


@dataclass
class KDALayerState:
    """One KDA layer's carry: ``recurrent [b, H, K, V]`` and ``conv_{q,k,v} [b, proj, kernel − 1]``."""

    recurrent: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor

    def store(self, recurrent: torch.Tensor, conv_q: torch.Tensor, conv_k: torch.Tensor,
              conv_v: torch.Tensor) -> None:
        """Take the layer's new carry (the grown cache rebinds to the new tensors)."""
        self.recurrent, self.conv_q, self.conv_k, self.conv_v = recurrent, conv_q, conv_k, conv_v

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.recurrent, self.conv_q, self.conv_k, self.conv_v


@dataclass
class MLALayerState:
    """One MLA layer's cache: ``latent [b, seen, kv_lora_rank + qk_rope_head_dim]`` (before the latent norm)."""

    latent: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.latent,)


def _kda_zeros(cfg: K3Config, batch_size: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A KDA layer's carry before any token: ``recurrent [b, H, K, V]`` and ``conv_{q,k,v} [b, proj, kernel − 1]``,
    all zeros, float32 (the recurrence and the conv history accumulate in float32 whatever the model dtype)."""
    la = cfg.linear_attn_config
    conv = (batch_size, cfg.kda_proj_size, la.short_conv_kernel_size - 1)
    return {"recurrent": torch.zeros(batch_size, la.num_heads, la.head_dim, la.head_dim, dtype=torch.float32,
                                     device=device),
            **{name: torch.zeros(conv, dtype=torch.float32, device=device) for name in ("conv_q", "conv_k", "conv_v")}}


class K3Cache:
    """Decoding state of one batch. Create with ``KimiK3ForCausalLM.init_cache(batch_size)``."""

    def __init__(self, cfg: K3Config, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"K3Cache: batch_size={batch_size!r}: expected a positive integer")
        self.batch_size = batch_size
        self.seen_tokens = 0
        # [batch, seen] bool, 1 = real token; None while every token seen so far is real.
        self.attention_mask: torch.Tensor | None = None
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.layers: list[KDALayerState | MLALayerState] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):
                self.layers.append(KDALayerState(**_kda_zeros(cfg, batch_size, device)))
            else:
                self.layers.append(MLALayerState(torch.zeros(batch_size, 0, latent, dtype=dtype, device=device)))

    def nbytes(self) -> int:
        """Bytes held by all layer states."""
        return sum(t.numel() * t.element_size() for s in self.layers for t in s.tensors())

    def advance(self, new_tokens: int, key_mask: torch.Tensor | None) -> None:
        """Record a forward of ``new_tokens`` tokens; ``key_mask [batch, seen + new]`` bool, None while all real."""
        self.seen_tokens += new_tokens
        self.attention_mask = key_mask

    def __repr__(self) -> str:
        return f"K3Cache(batch_size={self.batch_size}, seen_tokens={self.seen_tokens}, layers={len(self.layers)})"


class StaticKDALayerState(KDALayerState):
    """One KDA layer's carry in preallocated tensors: a new carry is copied in, never rebound, so a captured
    CUDA graph keeps reading and writing the same memory."""

    def store(self, recurrent: torch.Tensor, conv_q: torch.Tensor, conv_k: torch.Tensor,
              conv_v: torch.Tensor) -> None:
        self.recurrent.copy_(recurrent)
        self.conv_q.copy_(conv_q)
        self.conv_k.copy_(conv_k)
        self.conv_v.copy_(conv_v)


class _Fill:
    """The host-side count of tokens in a static cache, shared by the cache and its MLA layer states."""

    def __init__(self) -> None:
        self.tokens = 0


@dataclass
class StaticMLALayerState:
    """One MLA layer's latent in preallocated tensors: ``ckv [b, max_len, kv_lora_rank]`` (after
    ``kv_a_layernorm``, model dtype) and ``kpe [b, max_len, qk_rope_head_dim]`` (the shared key part)."""

    ckv: torch.Tensor
    kpe: torch.Tensor
    fill: _Fill

    def append(self, ckv_new: torch.Tensor, kpe_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[b, s, ·]`` new tokens at the host position; returns the views of every token so far,
        ``(ckv [b, seen + s, C], kpe [b, seen + s, R])``."""
        past, s = self.fill.tokens, ckv_new.shape[1]
        if past + s > self.ckv.shape[1]:
            raise ValueError(f"StaticK3Cache: {past} + {s} tokens exceed its max_len {self.ckv.shape[1]}")
        self.ckv[:, past:past + s] = ckv_new
        self.kpe[:, past:past + s] = kpe_new
        return self.ckv[:, :past + s], self.kpe[:, :past + s]

    def write_at(self, position: torch.Tensor, ckv_new: torch.Tensor, kpe_new: torch.Tensor) -> None:
        """Write one token per row ``[b, 1, ·]`` at the device-side ``position`` ([1] int64): no host sync."""
        self.ckv.index_copy_(1, position, ckv_new)
        self.kpe.index_copy_(1, position, kpe_new)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ckv, self.kpe


class StaticK3Cache:
    """Decoding state of one batch preallocated for ``max_len`` tokens (prompt + new), written in place.

    Create with ``KimiK3ForCausalLM.init_static_cache(batch_size, max_len)``. ``forward(..., cache=)`` fills it
    like ``K3Cache`` (same columns, same values: a prefill and host-positioned steps give the same logits);
    ``KimiK3ForCausalLM.decode_step`` advances it one token without allocating a cache tensor, and with
    ``mla_attention`` from the device-side ``position`` alone (what a CUDA graph captures). ``rows(n)`` is a view
    of the first ``n`` rows sharing the storage; ``reset()`` empties it for the next batch.
    """

    def __init__(self, cfg: K3Config, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"StaticK3Cache: batch_size={batch_size!r}: expected a positive integer")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"StaticK3Cache: max_len={max_len!r}: expected a positive integer")
        self.batch_size, self.max_len = batch_size, max_len
        self._fill = _Fill()
        self._all_real = True
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.layers: list[StaticKDALayerState | StaticMLALayerState] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):
                self.layers.append(StaticKDALayerState(**_kda_zeros(cfg, batch_size, device)))
            else:
                self.layers.append(StaticMLALayerState(
                    ckv=torch.zeros(batch_size, max_len, cfg.kv_lora_rank, dtype=dtype, device=device),
                    kpe=torch.zeros(batch_size, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device),
                    fill=self._fill,
                ))

    # ---------------------------------------------------------------- what forward() reads and records
    @property
    def seen_tokens(self) -> int:
        return self._fill.tokens

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """``[batch, seen]`` bool over the tokens so far, or None while every one is real (as ``K3Cache``)."""
        return None if self._all_real else self.key_mask[:, :self.seen_tokens]

    @property
    def all_real(self) -> bool:
        """No padding among the tokens so far (host-side: known since the prefill)."""
        return self._all_real

    def advance(self, new_tokens: int, key_mask: torch.Tensor | None) -> None:
        """Record a forward of ``new_tokens`` tokens: mark them in the key mask (``key_mask [batch, seen + new]``,
        None = all real) and move both positions on."""
        past = self.seen_tokens
        total = past + new_tokens
        if key_mask is None:
            self.key_mask[:, past:total] = True
        else:
            self.key_mask[:, :total].copy_(key_mask)
            self._all_real = False
        self._fill.tokens = total
        self.position.fill_(total)

    def begin_host_step(self) -> torch.Tensor | None:
        """Open one token at the host position: mark its column real; returns the key mask over the tokens so
        far and this one (``[batch, seen + 1]`` bool, a view), or None while every token is real."""
        past = self.seen_tokens
        if past + 1 > self.max_len:
            raise ValueError(f"StaticK3Cache: full ({self.max_len} tokens), no room for another")
        self.key_mask[:, past] = True
        return None if self._all_real else self.key_mask[:, :past + 1]

    def end_host_step(self) -> None:
        """Close the token ``begin_host_step`` opened: both positions move on by one."""
        self._fill.tokens += 1
        self.position.fill_(self._fill.tokens)

    def note_device_step(self) -> None:
        """Account on the host for one ``decode_step`` that ran from the device position (it cannot do this
        itself: a replayed CUDA graph runs no Python). The key mask and ``position`` it already advanced."""
        self._fill.tokens += 1

    # ---------------------------------------------------------------- storage
    def reset(self) -> None:
        """Empty the cache for a new batch: zero every state (so a masked, never written slot holds no NaN that
        a zero attention weight could turn into a NaN output), clear the mask, positions to 0."""
        for s in self.layers:
            for t in s.tensors():
                t.zero_()
        self.key_mask.zero_()
        self.position.zero_()
        self._fill.tokens = 0
        self._all_real = True

    def rows(self, n: int) -> "StaticK3Cache":
        """A cache over the first ``n`` rows, sharing this one's storage, ``position`` and fill count (one batch
        uses the storage at a time)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"StaticK3Cache.rows({n}): expected 1 <= n <= batch_size ({self.batch_size})")
        view = object.__new__(StaticK3Cache)
        view.batch_size, view.max_len = n, self.max_len
        view._fill, view._all_real = self._fill, True
        view.key_mask, view.position = self.key_mask[:n], self.position
        view.layers = [
            StaticKDALayerState(*(t[:n] for t in s.tensors())) if isinstance(s, StaticKDALayerState)
            else StaticMLALayerState(s.ckv[:n], s.kpe[:n], self._fill)
            for s in self.layers
        ]
        return view

    def nbytes(self) -> int:
        """Bytes held by the layer states and the mask."""
        tensors = [t for s in self.layers for t in s.tensors()] + [self.key_mask]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return (f"StaticK3Cache(batch_size={self.batch_size}, max_len={self.max_len}, "
                f"seen_tokens={self.seen_tokens}, layers={len(self.layers)})")
