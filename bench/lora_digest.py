"""Cost of the run-health digests (issue #23): ``k3.lora.digest.tensor_digests`` over a rank's adapter tensors
(the ``replicas`` event after every optimizer step) and ``chunk_digest`` over an exported chunk (every sync).

The digest reads every element (exact, not sampled): a few elementwise int64 passes per tensor and one
device-to-host copy per call. Reported: seconds per call and the bytes of adapter hashed per second.

    python bench/lora_digest.py --device cpu --mbytes 8 --tensors 64
    python bench/lora_digest.py --device cuda --mbytes 2048 --tensors 600
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3.lora.digest import chunk_digest, tensor_digests


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mbytes", type=float, default=8.0, help="adapter bytes held by the rank (MiB, BF16)")
    ap.add_argument("--tensors", type=int, default=64, help="how many tensors they are split into")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    numel = int(args.mbytes * 2**20 / 2 / args.tensors)
    tensors = [torch.randn(numel, device=device).to(torch.bfloat16) for _ in range(args.tensors)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = {"replica digests (tensor_digests)": lambda: tensor_digests(tensors),
             "chunk digest (chunk_digest)": lambda: chunk_digest([(f"t{i}", t) for i, t in enumerate(tensors)])}
    for name, fn in times.items():
        fn()  # warm-up
        samples = []
        for _ in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - t0)
        s = statistics.median(samples)
        print(f"{name}: {args.tensors} tensors, {nbytes / 2**20:.1f} MiB BF16 on {device}: {s * 1e3:.2f} ms "
              f"({nbytes / s / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
