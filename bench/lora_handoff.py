"""Adapter sync benchmark: export + hand-off of a K3 LoRA adapter to a second process, and the memory gate.

Only the adapters are materialized (the base model stays on the meta device), so the full 896-expert adapter
fits on one GPU. Per sync: ``export_chunks`` -> one bucket per chunk (fresh, or the persistent transfer buffer)
-> CUDA IPC / shared memory -> the receiver copies each chunk out and acks. The export either makes fresh BF16
copies that the producer then copies into the bucket ("copied in"), or writes each chunk straight into its bucket
(``out=producer.bucket_for``, "in place", what ``k3 train`` does): one full copy of the adapter fewer per sync.
Reports the sync time, the adapter bytes per second, and the producer's memory after every sync against the
baseline (the recipe's "allocated returns to baseline after every weight sync").

    python bench/lora_handoff.py --device cuda --variant full --rank 32 --syncs 5
    python bench/lora_handoff.py --device cpu --variant tiny --rank 16 --syncs 20
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch import nn

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.export import adapter_nbytes, chunk_layout, export_chunks
from k3.model import KimiK3ForCausalLM
from k3.transport.handoff import AdapterProducer, AdapterReceiver, TransferBuffer, spawn_receiver
from k3.transport.leakcheck import LeakCheck


def _discard(version, tensors, config) -> None:
    """An engine stand-in that takes the adapter and drops it (the copy out of the bucket is the cost)."""


def adapter_only_model(name: str, rank: int, device: str) -> nn.Module:
    """A K3 whose base stays on the meta device and whose adapters are real random tensors on ``device``."""
    with torch.device("meta"):
        model = apply_lora(KimiK3ForCausalLM(variant(name)), LoRAConfig(rank=rank, alpha=2 * rank))
    real: dict[int, nn.Parameter] = {}  # by the meta Parameter's id: the fc1 A is tied between gate and up
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and p.is_meta and "lora_" in pname:
                if id(p) not in real:
                    real[id(p)] = nn.Parameter(torch.randn(p.shape, dtype=torch.bfloat16, device=device) * 0.01)
                module._parameters[pname] = real[id(p)]
    return model


def run(args: argparse.Namespace) -> list[dict]:
    model = adapter_only_model(args.variant, args.rank, args.device)
    layout = chunk_layout(model.config, model.lora_config)
    expected = {n: s for spec in layout for n, s in spec.tensors}
    nbytes = adapter_nbytes(layout)
    rows = []
    for buffered, in_place in ((False, False), (False, True), (True, False), (True, True)):
        receiver = functools.partial(AdapterReceiver, expected=expected, on_activate=_discard, device=args.device,
                                     digest=False)
        proc, conn = spawn_receiver(receiver)
        gate = LeakCheck(device=args.device if args.device != "cpu" else None)
        buffer = TransferBuffer(args.device, torch.bfloat16) if buffered else None
        producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=600)
        times = []
        for v in range(1, args.syncs + 2):
            if v == 2:
                gate.set_baseline()
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ack = producer.send_version(export_chunks(model, v, out=producer.bucket_for if in_place else None))
            if args.device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            assert ack.ok and ack.active_version == v
            if v >= 2:
                times.append(dt)
                gate.end_sync()
        report = gate.report()
        after = [s.cuda_allocated_bytes for s in gate.samples] if args.device == "cuda" else [s.rss_bytes for s in gate.samples]
        base = gate.baseline.cuda_allocated_bytes if args.device == "cuda" else gate.baseline.rss_bytes
        rows.append({
            "mode": ("transfer buffer" if buffered else "fresh bucket per chunk")
            + (", exported in place" if in_place else ", copied in"),
            "chunks": len(layout), "adapter_mb": nbytes / 1e6,
            "sync_s_median": statistics.median(times), "sync_s_min": min(times),
            "gb_per_s": nbytes / 1e9 / statistics.median(times),
            "max_excess_mib": max(a - base for a in after) / 2**20,
            "baseline_gb": base / 1e9,
            "buffer_mib": (buffer.capacity * 2 / 2**20) if buffer is not None else 0.0,
            "gate": "PASS" if report.ok else f"FAIL at sync {report.first_bad_sync}",
        })
        producer.close()
        proc.join(timeout=120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", default="full", help="full | 4layer | tiny")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--syncs", type=int, default=5, help="timed syncs after one warm-up")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {args.variant} r={args.rank} on {dev}, torch {torch.__version__}, {args.syncs} syncs after 1 warm-up")
    print("| mode | chunks | adapter MB | sync s (median) | sync s (min) | GB/s | max excess after sync MiB | "
          "baseline GB | buffer MiB | gate |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in run(args):
        print(f"| {r['mode']} | {r['chunks']} | {r['adapter_mb']:,.1f} | {r['sync_s_median']:.3f} | "
              f"{r['sync_s_min']:.3f} | {r['gb_per_s']:.2f} | {r['max_excess_mib']:.3f} | {r['baseline_gb']:.2f} | "
              f"{r['buffer_mib']:.1f} | {r['gate']} |")


if __name__ == "__main__":
    main()
