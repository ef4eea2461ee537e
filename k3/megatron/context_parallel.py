"""Context parallelism (CP) for K3 on the megatron backend: the token layout and the exchanges KDA and MLA need.

**One token layout for the whole model: megatron's load-balanced causal split.** A sequence of ``S`` tokens is
cut into ``2·cp`` chunks of ``c = S / (2·cp)`` tokens; CP rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``,
concatenated ``[front | back]`` on the sequence dim (:func:`split_for_cp_rank`, as megatron's
``get_batch_on_this_cp_rank`` and the recipe's zigzag order). Why this layout, and not contiguous shards:

- MLA is causal softmax attention. With contiguous shards rank ``cp − 1`` scores its queries against the whole
  sequence and rank 0 against ``1/cp`` of it; the balanced pair gives every rank the same work. MLA all-gathers
  K/V over CP and masks by the global token positions (:func:`cp_causal_attention`).
- KDA's recurrence needs sequence order, but each zigzag chunk is still a contiguous run of tokens: the chain of
  the ``2·cp`` chunks visits ranks ``0, 1, …, cp − 1`` (front chunks) and then ``cp − 1, …, 0`` (back chunks).
  So the torch path passes the recurrent state along that chain (:func:`cp_kda_core`) and moves no activation.
  Its serial time is the same as a contiguous layout's chain (the ``S`` tokens in order either way), and it
  saves the two all-to-alls per KDA layer a zigzag → contiguous → zigzag conversion would cost. fla 0.6.0's
  CP path takes this layout natively (``build_cp_context(..., layout="zigzag")``) and runs the chain in
  parallel (per-rank affine state summaries, all-gathered), so on CUDA the core goes there.
- The short convolutions need the ``kernel − 1`` inputs before each chunk: the front chunk's come from rank
  ``r − 1``'s front chunk, the back chunk's from rank ``r + 1``'s back chunk (rank ``cp − 1``: its own front
  chunk); one neighbour exchange per layer moves those halos (:func:`cp_causal_conv`).
- Everything else is per token: the embedding, norms, AttnRes mixes (the bank rows are per-token tensors:
  a mix over depth never looks at another token), the MLP and MoE, the LoRA deltas, the LM head and the
  per-token loss run on the local tokens as they are. The trainer (``k3.megatron.training``) hands each rank
  its tokens of every micro-batch (:func:`cp_local_tokens`); its token-mean loss divides by the micro-batch's
  token count over CP, and its forward-only log-probs are gathered back into sequence order
  (:func:`cp_gather_tokens`).

**Packed sequences (THD) under CP** (``cu_seqlens``: the whole sequences' bounds, ``k3.megatron.packed``): each
sequence is split as above on its own, so its length must be a positive multiple of ``2·cp`` (the trainer pads
inside each sequence, after its last token, where padding changes nothing before it), and the rank's stream is
``[front_0 | back_0 | front_1 | back_1 | …]`` with bounds ``cu_seqlens / cp`` (megatron's THD convention). Every
primitive takes ``cu_seqlens`` and works per sequence: the conv halos move one tail per sequence and chunk (one
exchange for all), the KDA state chain carries one state per sequence (the front chunks of all sequences run as one
packed call, then the back chunks), MLA attends within each sequence over its all-gathered keys, and the split /
gather helpers cut and reassemble per sequence.

Gradients: every exchange here is an autograd function whose backward sends the gradient back where the
forward's data came from, so each rank's parameters get their share of the whole sequence's gradient, and
megatron's DDP reduction over DP × CP sums the shares (with the schedule's ``× cp`` loss scale undoing DDP's
``1 / (dp·cp)`` average, megatron's own convention).

The p2p functions decide whether they take part in the backward by whether their inputs require grad (they
always do or never do on every CP rank alike, as the ranks run the same layer). The state chain serialises the
KDA cores across CP ranks. Under megatron's full recompute every CP rank recomputes the same layer at the same
point of the backward, so the chain's messages pair up again (tests/parity/test_megatron_packed.py: packed CP2
with full recompute equals TP1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3.kernels.kda.fla import fla_available, kda_core
from k3.megatron.packed import check_bounds, packed_causal_conv

__all__ = [
    "all_gather_sequence",
    "cp_causal_attention",
    "cp_causal_conv",
    "cp_chunk_ids",
    "cp_gather_tokens",
    "cp_kda_core",
    "cp_local_tokens",
    "cp_packed_index",
    "cp_token_positions",
    "exchange_halo",
    "merge_cp_shards",
    "split_for_cp_rank",
]


# ---------------------------------------------------------------------------------------------- the layout
def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp_size``) CP rank ``cp_rank`` holds: ``(cp_rank, 2·cp_size − 1 − cp_rank)``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_chunk_ids: rank {cp_rank} of CP size {cp_size}: expected 0 <= rank < size")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_len(seq: int, cp_size: int) -> int:
    if seq % (2 * cp_size):
        raise ValueError(f"context parallelism {cp_size} needs the sequence length to be a multiple of "
                         f"2 x {cp_size} = {2 * cp_size} (load-balanced split), got {seq}; pad the batch")
    return seq // (2 * cp_size)


def _packed_chunks(cu_seqlens, cp_size: int) -> torch.Tensor:
    """Chunk length ``L_n / (2·cp)`` of every packed sequence (host int64 ``[N]``); each ``L_n`` must be a positive
    multiple of ``2·cp``."""
    cu = check_bounds(cu_seqlens, what="context parallelism: cu_seqlens")
    lengths = cu[1:] - cu[:-1]
    bad = [(n, int(x)) for n, x in enumerate(lengths.tolist()) if x <= 0 or x % (2 * cp_size)]
    if bad:
        raise ValueError(f"context parallelism {cp_size} needs every packed sequence to be a positive multiple of "
                         f"2 x {cp_size} = {2 * cp_size} tokens (load-balanced split), got (sequence, length) "
                         f"{bad[:4]}; pad inside each sequence")
    return lengths // (2 * cp_size)


def cp_packed_index(cu_seqlens, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions in the whole packed stream (``cu_seqlens``: whole sequences) of CP rank ``cp_rank``'s tokens, in
    its local order: for each sequence its chunk ``r`` then its chunk ``2·cp − 1 − r`` (``[T / cp]`` int64)."""
    cu = check_bounds(cu_seqlens, what="context parallelism: cu_seqlens")
    chunks = _packed_chunks(cu, cp_size)
    front, back = cp_chunk_ids(cp_rank, cp_size)
    parts = []
    for start, c in zip(cu[:-1].tolist(), chunks.tolist()):
        parts += [torch.arange(start + front * c, start + (front + 1) * c),
                  torch.arange(start + back * c, start + (back + 1) * c)]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


def _packed_order(cu_seqlens, cp_size: int, device=None) -> torch.Tensor:
    """Index into the rank-major concatenation of every rank's packed stream that gives the whole stream's order."""
    held = torch.cat([cp_packed_index(cu_seqlens, cp_size, r) for r in range(cp_size)])
    return torch.argsort(held).to(device)


def split_for_cp_rank(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int, cu_seqlens=None) -> torch.Tensor:
    """This rank's tokens of ``t`` (the whole sequence on ``dim``): chunks ``r`` and ``2·cp − 1 − r``
    concatenated, ``seq / cp`` tokens; with ``cu_seqlens`` (packed sequences on ``dim``) the same per sequence.
    ``cp_size == 1`` returns ``t``."""
    if cp_size == 1:
        return t
    if cu_seqlens is not None:
        return t.index_select(dim, cp_packed_index(cu_seqlens, cp_size, cp_rank, t.device))
    c = _chunk_len(t.shape[dim], cp_size)
    front, back = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat([t.narrow(dim, front * c, c), t.narrow(dim, back * c, c)], dim=dim)


def _global_order(cp_size: int, c: int, device=None) -> torch.Tensor:
    """Index into the rank-major concatenation of every rank's ``[front | back]`` that gives sequence order."""
    index = []
    for chunk in range(2 * cp_size):
        rank = chunk if chunk < cp_size else 2 * cp_size - 1 - chunk
        start = rank * 2 * c + (0 if chunk < cp_size else c)
        index.append(torch.arange(start, start + c, device=device))
    return torch.cat(index)


def merge_cp_shards(shards: list[torch.Tensor], dim: int, cu_seqlens=None) -> torch.Tensor:
    """Inverse of :func:`split_for_cp_rank`: every rank's local tensor (rank order) -> the whole sequence (or, with
    ``cu_seqlens``, the whole packed stream)."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    if cu_seqlens is not None:
        joined = torch.cat(shards, dim=dim)
        return joined.index_select(dim, _packed_order(cu_seqlens, cp, joined.device))
    local = shards[0].shape[dim]
    if local % 2 or any(s.shape[dim] != local for s in shards):
        raise ValueError(f"merge_cp_shards: local lengths {[s.shape[dim] for s in shards]}: expected one even "
                         "length on every rank")
    joined = torch.cat(shards, dim=dim)
    return joined.index_select(dim, _global_order(cp, local // 2, joined.device))


def cp_token_positions(seq_local: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_local]`` (long) of this rank's tokens in the whole sequence."""
    positions = torch.arange(seq_local * cp_size, device=device)
    return split_for_cp_rank(positions, 0, cp_size, cp_rank)


def cp_local_tokens(t: torch.Tensor, group, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This CP rank's tokens of a whole-sequence tensor (``[batch, seq]`` inputs, labels, loss mask; with
    ``cu_seqlens``, of a packed ``[1, T]`` one)."""
    if group is None or group.size() == 1:
        return t
    return split_for_cp_rank(t, dim, group.size(), group.rank(), cu_seqlens)


@torch.no_grad()
def cp_gather_tokens(t: torch.Tensor, group, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """Inverse of :func:`cp_local_tokens` over the group: every rank's tokens gathered into the whole sequence
    (in order) on every rank, without gradient (per-token log-probs of a forward-only pass)."""
    if group is None or group.size() == 1:
        return t
    pieces = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return merge_cp_shards(pieces, dim, cu_seqlens)


# ---------------------------------------------------------------------------------------------- p2p helpers
def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def _send(t: torch.Tensor, to: int, group) -> None:
    dist.send(t.contiguous(), dst=_peer(group, to), group=group)


def _recv(like: torch.Tensor, shape, dtype, frm: int, group) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=like.device)
    dist.recv(buf, src=_peer(group, frm), group=group)
    return buf


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group) -> None:
    """Post every send and receive at once and wait (a neighbour exchange that cannot deadlock on NCCL)."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), _peer(group, r), group) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, buf, _peer(group, r), group) for buf, r in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ---------------------------------------------------------------------------------------------- conv halos
class _HaloExchange(torch.autograd.Function):
    """``(front_tail, back_tail) -> (front_halo, back_halo)``: the inputs before this rank's two chunks.

    Forward: the front tail goes to rank ``r + 1`` (it precedes that rank's front chunk), the back tail to rank
    ``r − 1`` (it precedes that rank's back chunk); rank 0's front halo is zeros (the sequence start), rank
    ``cp − 1``'s back halo is its own front tail. Backward sends each halo's gradient back to its owner.
    """

    @staticmethod
    def forward(ctx, front_tail: torch.Tensor, back_tail: torch.Tensor, group):
        ctx.group = group
        r, cp = group.rank(), group.size()
        front_halo, back_halo = torch.zeros_like(front_tail), torch.empty_like(back_tail)
        sends, recvs = [], []
        if r > 0:
            recvs.append((front_halo, r - 1))
            sends.append((back_tail, r - 1))
        if r < cp - 1:
            sends.append((front_tail, r + 1))
            recvs.append((back_halo, r + 1))
        _exchange(sends, recvs, group)
        if r == cp - 1:
            back_halo = front_tail.clone()
        return front_halo, back_halo

    @staticmethod
    def backward(ctx, g_front_halo: torch.Tensor, g_back_halo: torch.Tensor):
        group = ctx.group
        r, cp = group.rank(), group.size()
        # contiguous receive buffers: the halos' gradients may arrive as strided views
        dense = torch.contiguous_format
        g_front_tail = torch.zeros_like(g_front_halo, memory_format=dense)
        g_back_tail = torch.zeros_like(g_back_halo, memory_format=dense)
        sends, recvs = [], []
        if r > 0:
            sends.append((g_front_halo, r - 1))
            recvs.append((g_back_tail, r - 1))
        if r < cp - 1:
            recvs.append((g_front_tail, r + 1))
            sends.append((g_back_halo, r + 1))
        _exchange(sends, recvs, group)
        if r == cp - 1:
            g_front_tail = g_front_tail + g_back_halo
        return g_front_tail, g_back_tail, None


def exchange_halo(front_tail: torch.Tensor, back_tail: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kernel − 1`` inputs before this rank's front and back chunks (see :class:`_HaloExchange`); tails
    ``[batch, kernel − 1, channels]``, the last inputs of this rank's front / back chunk."""
    return _HaloExchange.apply(front_tail, back_tail, group)


def cp_causal_conv(inputs: list[torch.Tensor], convs: list[torch.nn.Module], group,
                   cu_seqlens=None) -> list[torch.Tensor]:
    """Each ``convs[i]`` (a ``k3.model.kda.CausalConv1d``) over ``inputs[i]`` ``[batch, seq_local, channels_i]``
    in the load-balanced layout, exactly as over the whole sequence; returns ``[batch, seq_local, channels_i]``
    float32 each. One halo exchange carries all inputs (concatenated on channels). With ``cu_seqlens`` (whole
    packed sequences; inputs ``[1, T / cp, channels_i]``) each sequence is convolved on its own."""
    kernel = {conv.kernel_size for conv in convs}
    if len(kernel) != 1:
        raise ValueError(f"cp_causal_conv: the convolutions have different kernel sizes {sorted(kernel)}")
    halo = kernel.pop() - 1
    if cu_seqlens is not None:
        return _cp_packed_conv(inputs, convs, group, cu_seqlens, halo)
    seq = inputs[0].shape[1]
    c = seq // 2
    if seq % 2 or c < halo:
        raise ValueError(f"cp_causal_conv: {seq} local tokens = 2 chunks of {seq / 2}: each chunk needs at least "
                         f"kernel - 1 = {halo} tokens (a longer sequence or a smaller context-parallel size)")
    u = torch.cat([x.float() for x in inputs], dim=-1)
    front_halo, back_halo = exchange_halo(u[:, c - halo:c], u[:, seq - halo:], group)
    outs, start = [], 0
    for x, conv in zip(inputs, convs):
        end = start + x.shape[-1]
        # CausalConv1d takes its history as [batch, channels, kernel - 1]
        y_front, _ = conv(x[:, :c], front_halo[..., start:end].transpose(1, 2))
        y_back, _ = conv(x[:, c:], back_halo[..., start:end].transpose(1, 2))
        outs.append(torch.cat([y_front, y_back], dim=1))
        start = end
    return outs


def _cp_packed_conv(inputs, convs, group, cu_seqlens, halo: int) -> list[torch.Tensor]:
    """:func:`cp_causal_conv` on packed sequences: the halos of every sequence's two chunks in one exchange (the
    sequences are the exchange's batch), then each chunk convolved after its halo (``packed_causal_conv``)."""
    cp = group.size()
    chunks = _packed_chunks(cu_seqlens, cp)
    local = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(2 * chunks, 0)])  # the rank's bounds
    n = chunks.numel()
    if inputs[0].shape[:2] != (1, int(local[-1])):
        raise ValueError(f"cp_causal_conv: inputs {tuple(inputs[0].shape)}: expected [1, {int(local[-1])}, channels] "
                         "(this rank's tokens of the packed sequences)")
    if bool((chunks < halo).any()):
        raise ValueError(f"cp_causal_conv: packed chunks of {chunks.tolist()[:8]} tokens: each chunk needs at least "
                         f"kernel - 1 = {halo} tokens (pad each sequence to 2 x {cp} x {halo} tokens or more)")
    u = torch.cat([x.float() for x in inputs], dim=-1)[0]  # [T_local, channels]
    device, width = u.device, u.shape[-1]
    steps = torch.arange(halo)
    front_end, back_end = local[:-1] + chunks, local[1:]
    tails = [u.index_select(0, (end.unsqueeze(1) - halo + steps).reshape(-1).to(device)).view(n, halo, width)
             for end in (front_end, back_end)]
    front_halo, back_halo = exchange_halo(tails[0], tails[1], group)  # [sequences, kernel − 1, channels]
    # the rank's 2N chunks in stream order (front_0, back_0, front_1, …) and the history of each
    chunk_bounds = torch.stack([local[:-1], front_end], dim=1).reshape(-1)
    chunk_bounds = torch.cat([chunk_bounds, local[-1:]])
    history = torch.stack([front_halo, back_halo], dim=1).reshape(2 * n, halo, width).transpose(1, 2)
    outs, start = [], 0
    for x, conv in zip(inputs, convs):
        end = start + x.shape[-1]
        outs.append(packed_causal_conv(x, conv, chunk_bounds, history[:, start:end]))
        start = end
    return outs


# ---------------------------------------------------------------------------------------------- KDA state chain
class _RecvState(torch.autograd.Function):
    """Receive the state from CP rank ``frm``; backward sends its gradient back. ``anchors`` (this chunk's
    inputs) only tie the node into the graph: it takes part in the backward exactly when they require grad."""

    @staticmethod
    def forward(ctx, shape, frm: int, group, *anchors):
        ctx.frm, ctx.group, ctx.n = frm, group, len(anchors)
        return _recv(anchors[0], shape, torch.float32, frm, group)

    @staticmethod
    def backward(ctx, g_state: torch.Tensor):
        _send(g_state, ctx.frm, ctx.group)
        return (None, None, None) + (None,) * ctx.n


class _SwapState(torch.autograd.Function):
    """Send ``state`` to CP rank ``peer`` and receive one back (rank ``r``'s front-chunk state goes to ``r + 1``,
    whose back-chunk state is the start of ``r``'s back chunk). Backward: the same, with the gradients."""

    @staticmethod
    def forward(ctx, state: torch.Tensor, peer: int, group):
        ctx.peer, ctx.group = peer, group
        _send(state, peer, group)
        return _recv(state, state.shape, state.dtype, peer, group)

    @staticmethod
    def backward(ctx, g_received: torch.Tensor):
        _send(g_received, ctx.peer, ctx.group)
        return _recv(g_received, g_received.shape, g_received.dtype, ctx.peer, ctx.group), None, None


class _SendStateAlong(torch.autograd.Function):
    """Send ``state`` to CP rank ``to`` and return ``carrier`` (this chunk's output, which the loss uses) so the
    send's backward, receiving the state's gradient, runs before the chunk's own backward needs it."""

    @staticmethod
    def forward(ctx, state: torch.Tensor, carrier: torch.Tensor, to: int, group):
        ctx.to, ctx.group = to, group
        ctx.shape, ctx.dtype = state.shape, state.dtype
        _send(state, to, group)
        return carrier.clone()

    @staticmethod
    def backward(ctx, g_carrier: torch.Tensor):
        return _recv(g_carrier, ctx.shape, ctx.dtype, ctx.to, ctx.group), g_carrier, None, None


def cp_kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, group, backend: str = "auto", cu_seqlens=None) -> torch.Tensor:
    """The KDA core of the whole sequence on this rank's load-balanced tokens; returns ``o`` ``[batch,
    seq_local, heads, V]`` in v's dtype (same inputs as ``k3.kernels.kda.fla.kda_core``, each ``[batch, seq_local,
    …]``: this rank's front chunk then its back chunk).

    ``backend``: ``auto`` = fla's CP kernels on CUDA when fla imports, else the torch state chain;
    ``fla`` / ``torch`` force one. The torch chain: the front chunk starts from rank ``r − 1``'s front-chunk
    state (zeros on rank 0) and hands its state to rank ``r + 1``; the back chunk starts from rank ``r + 1``'s
    back-chunk state (rank ``cp − 1``: its own front-chunk state) and hands its state to rank ``r − 1``.

    ``cu_seqlens``: whole packed sequences (inputs ``[1, T / cp, …]``, the rank's stream ``[front_0 | back_0 |
    …]``): the chain carries one state per sequence, the front chunks of all sequences run as one packed call and
    then the back chunks; fla's CP kernels run one sequence at a time.
    """
    if backend not in ("auto", "fla", "torch"):
        raise ValueError(f"cp_kda_core: backend={backend!r}: expected auto, fla or torch")
    if cu_seqlens is not None:
        return _cp_packed_kda(q, k, v, g, beta, scale, group, backend, cu_seqlens)
    seq = q.shape[1]
    if seq % 2:
        raise ValueError(f"cp_kda_core: {seq} local tokens: expected an even number (two chunks per rank)")
    r, cp = group.rank(), group.size()
    if backend == "fla" or (backend == "auto" and q.is_cuda and fla_available()):
        return _fla_cp_kda(q, k, v, g, beta, scale, group)
    c = seq // 2
    front = [t[:, :c] for t in (q, k, v, g, beta)]
    back = [t[:, c:] for t in (q, k, v, g, beta)]
    b, _, heads, dk = q.shape
    state_shape = (b, heads, dk, v.shape[-1])
    core = "torch_naive" if c == 1 else "torch_chunk"
    start = _RecvState.apply(state_shape, r - 1, group, *front) if r > 0 else None
    o_front, s_front = kda_core(*front, scale=scale, initial_state=start, backend=core)
    start_back = _SwapState.apply(s_front, r + 1, group) if r < cp - 1 else s_front
    o_back, s_back = kda_core(*back, scale=scale, initial_state=start_back, backend=core)
    if r > 0:
        o_back = _SendStateAlong.apply(s_back, o_back, r - 1, group)
    return torch.cat([o_front, o_back], dim=1)


def _cp_packed_kda(q, k, v, g, beta, scale, group, backend: str, cu_seqlens) -> torch.Tensor:
    """:func:`cp_kda_core` on packed sequences (see there)."""
    r, cp = group.rank(), group.size()
    chunks = _packed_chunks(cu_seqlens, cp)
    local = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(2 * chunks, 0)])
    if q.shape[:2] != (1, int(local[-1])):
        raise ValueError(f"cp_kda_core: q {tuple(q.shape)}: expected [1, {int(local[-1])}, heads, K] (this rank's "
                         "tokens of the packed sequences)")
    if backend == "fla" or (backend == "auto" and q.is_cuda and fla_available()):
        # fla's CP context describes one sequence split over the ranks: one call per sequence
        outs = [_fla_cp_kda(*(t[:, a:b] for t in (q, k, v, g, beta)), scale, group)
                for a, b in zip(local[:-1].tolist(), local[1:].tolist())]
        return torch.cat(outs, dim=1)
    front_idx = torch.cat([torch.arange(a, a + c) for a, c in zip(local[:-1].tolist(), chunks.tolist())])
    back_idx = torch.cat([torch.arange(a + c, b) for a, b, c in
                          zip(local[:-1].tolist(), local[1:].tolist(), chunks.tolist())])
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(chunks, 0)])  # of the front (or back) chunks
    front = [t.index_select(1, front_idx.to(t.device)) for t in (q, k, v, g, beta)]
    back = [t.index_select(1, back_idx.to(t.device)) for t in (q, k, v, g, beta)]
    state_shape = (chunks.numel(), q.shape[2], q.shape[3], v.shape[-1])
    core = "torch_naive" if int(chunks.max()) == 1 else "torch_chunk"
    start = _RecvState.apply(state_shape, r - 1, group, *front) if r > 0 else None
    o_front, s_front = kda_core(*front, scale=scale, initial_state=start, backend=core, cu_seqlens=bounds)
    start_back = _SwapState.apply(s_front, r + 1, group) if r < cp - 1 else s_front
    o_back, s_back = kda_core(*back, scale=scale, initial_state=start_back, backend=core, cu_seqlens=bounds)
    if r > 0:
        o_back = _SendStateAlong.apply(s_back, o_back, r - 1, group)
    out = o_front.new_zeros((1, q.shape[1], *o_front.shape[2:]))
    return out.index_copy(1, front_idx.to(out.device), o_front).index_copy(1, back_idx.to(out.device), o_back)


def _fla_cp_kda(q, k, v, g, beta, scale, group) -> torch.Tensor:
    """fla 0.6.0's CP ``chunk_kda`` on the zigzag layout, one sequence (batch row) at a time: fla's CP metadata
    describes one flattened token stream split over the ranks, and our rows are split each on their own."""
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:  # ImportError without fla; ModuleNotFoundError('triton') without Triton
        raise RuntimeError("cp_kda_core: backend='fla' needs flash-linear-attention with Triton and CUDA") from e
    b, seq = q.shape[:2]
    total = seq * group.size()
    cu = torch.tensor([0, total], dtype=torch.long)
    context = build_cp_context(cu.to(q.device), group=group, cu_seqlens_cpu=cu, layout="zigzag")
    outs = []
    for i in range(b):
        row = slice(i, i + 1)
        o, _ = fla_chunk_kda(q[row].to(v.dtype).contiguous(), k[row].to(v.dtype).contiguous(), v[row].contiguous(),
                             g[row].float().contiguous(), beta[row].float().contiguous(), scale=scale,
                             cp_context=context)
        outs.append(o)
    return torch.cat(outs, dim=0).to(v.dtype)


# ---------------------------------------------------------------------------------------------- MLA
class _AllGatherSeq(torch.autograd.Function):
    """All-gather ``[seq_local, …]`` over the CP group (rank-major) -> ``[cp·seq_local, …]``; backward:
    reduce-scatter (every rank's queries used these keys/values, so their gradients sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        group = ctx.group
        out = g.new_empty((g.shape[0] // group.size(), *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g.contiguous(), group=group)
        return out, None


def all_gather_sequence(x: torch.Tensor, dim: int, group, cu_seqlens=None) -> torch.Tensor:
    """Every rank's load-balanced ``x`` gathered over CP, in sequence order on ``dim`` (with gradient); with
    ``cu_seqlens``, the whole packed stream in order."""
    cp = group.size()
    if cp == 1:
        return x
    seq = x.shape[dim]
    gathered = _AllGatherSeq.apply(x.movedim(dim, 0), group)
    order = (_global_order(cp, seq // 2, x.device) if cu_seqlens is None
             else _packed_order(cu_seqlens, cp, x.device))
    return gathered.index_select(0, order).movedim(0, dim)


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group,
                        cu_seqlens=None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys/values.

    ``q``/``k``/``v`` ``[batch, heads, seq_local, dim]`` in the load-balanced layout (q/k dim may differ from
    v's). K and V are all-gathered over CP into sequence order; the mask lets the query at global position
    ``p`` see keys ``0 … p``. Returns ``[batch, heads, seq_local, v_dim]``. With ``cu_seqlens`` (whole packed
    sequences, batch 1) each sequence's queries attend over that sequence's keys alone.
    """
    cp, r = group.size(), group.rank()
    if cu_seqlens is not None:
        return _cp_packed_attention(q, k, v, scale, group, cu_seqlens)
    seq_local = q.shape[2]
    _chunk_len(seq_local * cp, cp)
    k_all = all_gather_sequence(k, 2, group)
    v_all = all_gather_sequence(v, 2, group)
    q_pos = cp_token_positions(seq_local, cp, r, q.device)
    k_pos = torch.arange(seq_local * cp, device=q.device)
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [seq_local, seq]: True = attend
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)


def _cp_packed_attention(q, k, v, scale, group, cu_seqlens) -> torch.Tensor:
    """:func:`cp_causal_attention` on packed sequences: one masked attention per sequence (its local queries over
    its gathered keys), so the work is the sequences' own, not the whole stream's."""
    cp, r = group.size(), group.rank()
    cu = check_bounds(cu_seqlens, what="cp_causal_attention: cu_seqlens")
    chunks = _packed_chunks(cu, cp)
    local = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(2 * chunks, 0)])
    if q.shape[0] != 1 or q.shape[2] != int(local[-1]):
        raise ValueError(f"cp_causal_attention: q {tuple(q.shape)}: expected [1, heads, {int(local[-1])}, dim] (this "
                         "rank's tokens of the packed sequences)")
    k_all = all_gather_sequence(k, 2, group, cu)
    v_all = all_gather_sequence(v, 2, group, cu)
    outs = []
    for n in range(chunks.numel()):
        a, b, start, end = int(local[n]), int(local[n + 1]), int(cu[n]), int(cu[n + 1])
        q_pos = cp_token_positions(b - a, cp, r, q.device)
        k_pos = torch.arange(end - start, device=q.device)
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k_all[:, :, start:end], v_all[:, :, start:end],
                                                   attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)
