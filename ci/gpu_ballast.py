#!/usr/bin/env python3
"""Hold all of a GPU's free memory but ``--leave-gib``, until stopped: the device shrunk to a budget.

`make smoke-gpu` proves the memory dance at a width whose trainer and engine fit an H200 twice over. Each actor's
``--gpu-memory-gb-per-actor`` cap is per process, so two actors under a cap of 35 GiB each could still hold 70 GiB
between them; what makes "the trainer and the engine cannot both be resident at once" true is a
device that holds only the budget. This process takes the rest (one plain ``cudaMalloc``-backed tensor, physical
memory committed), prints one line, and sleeps until SIGTERM / SIGINT.

    python3 ci/gpu_ballast.py --leave-gib 29.5 [--device 0]

Exit 0 when stopped; 1 with one line when the device has less than ``--leave-gib`` free.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

_GIB = 1024**3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leave-gib", type=float, required=True, help="GiB of the device to leave free")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_ballast: no CUDA device", file=sys.stderr)
        return 1
    torch.cuda.set_device(args.device)
    free, total = torch.cuda.mem_get_info(args.device)  # after this process's own context
    hold = free - int(args.leave_gib * _GIB)
    if hold < 0:
        print(f"gpu_ballast: cuda:{args.device} has {free / _GIB:.1f} GiB free, less than the {args.leave_gib:g} GiB "
              "to leave", file=sys.stderr)
        return 1
    ballast = torch.empty(hold, dtype=torch.uint8, device=f"cuda:{args.device}") if hold else None
    torch.cuda.synchronize()
    left, _ = torch.cuda.mem_get_info(args.device)
    print(f"gpu_ballast: holding {hold / _GIB:.1f} GiB of cuda:{args.device} ({total / _GIB:.1f} GiB); "
          f"{left / _GIB:.1f} GiB free for the run", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    del ballast
    return 0


if __name__ == "__main__":
    sys.exit(main())
