"""Where does fla's KDA spend its first calls? Times the first and the second call of each case the project
uses (tiny model shapes in bf16 and float32, forward only and forward + backward, K3 head shapes packed), so a
slow first compile/autotune is told apart from a hang: a case whose second call is fast compiled slowly.

    PYTHONPATH=/tmp/site:. python3 ci/gpu_fla_probe.py [--dump-every 60] [--cases tiny_bf16_fwd,...]

Prints one JSON line per call (``case``, ``call``, ``seconds``) and, every ``--dump-every`` seconds while a
call runs, every thread's Python stack to stderr (which kernel is being compiled or autotuned).
With ``TRITON_PRINT_AUTOTUNING=1`` Triton also prints each autotune and its time.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

import torch
import torch.nn.functional as F

from k3.kernels.kda.fla import kda_core

CASES = {
    # name: (batch, seq, heads, head_dim, dtype, backward, packed lengths or None)
    "tiny_bf16_fwd": (16, 48, 4, 16, torch.bfloat16, False, None),
    "tiny_bf16_fwd_bwd": (16, 48, 4, 16, torch.bfloat16, True, None),
    "tiny_fp32_fwd_bwd": (16, 48, 4, 16, torch.float32, True, None),
    "k3_bf16_fwd_bwd": (1, 1024, 96, 128, torch.bfloat16, True, None),
    "k3_bf16_packed_fwd_bwd": (1, 1024, 96, 128, torch.bfloat16, True, [300, 1, 0, 700, 23]),
}


def inputs(batch, seq, heads, dim, dtype, backward, lengths):
    gen = torch.Generator().manual_seed(0)
    shape = (batch, seq, heads, dim)
    q = F.normalize(torch.randn(shape, generator=gen), dim=-1)
    k = F.normalize(torch.randn(shape, generator=gen), dim=-1)
    v = torch.randn(shape, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(shape, generator=gen))
    beta = torch.rand(shape[:3], generator=gen)
    tensors = [t.to("cuda", dtype if i < 3 else torch.float32).requires_grad_(backward)
               for i, t in enumerate((q, k, v, g, beta))]
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return tensors, cu


def run_case(name: str, calls: int) -> None:
    batch, seq, heads, dim, dtype, backward, lengths = CASES[name]
    if lengths is not None:
        seq = sum(lengths)
    (q, k, v, g, beta), cu = inputs(batch, seq, heads, dim, dtype, backward, lengths)
    for call in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            o, state = kda_core(q, k, v, g, beta, backend="fla", cu_seqlens=cu, gate_lower_bound=-5.0)
            if backward:
                (o.float().square().sum() + state.square().sum()).backward()
        torch.cuda.synchronize()
        print(json.dumps({"case": name, "call": call, "seconds": round(time.perf_counter() - t0, 4),
                          "finite": bool(torch.isfinite(o).all())}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-every", type=float, default=60.0, help="seconds between stack dumps during a call")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.dump_every, repeat=True, file=sys.stderr)
    for name in args.cases.split(","):
        print(f"== {name}", file=sys.stderr, flush=True)
        run_case(name, args.calls)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
