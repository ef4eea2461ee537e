"""Adapter hand-off between two processes on one GPU: one routed-expert chunk, fresh bucket vs persistent buffer.

    python bench/gpu_ipc.py --out $OUT/gpu_ipc.json      # K3 routed experts, 896 experts, r 32 (~505 MiB BF16)

The chunk is the routed-expert group of one layer as ``k3.lora.export`` streams it (w1/w3 A ``(1, r, latent)``,
B ``(E, F, r)``; w2 A ``(E, r, F)``, B ``(1, latent, r)``), random BF16 on the device. A spawned receiver
(``k3.transport.handoff.AdapterReceiver``) copies it out of the CUDA IPC bucket and acks; the producer then
releases the bucket. Per mode, one warm-up sync, then ``--syncs`` timed syncs, each followed by the leak gate
(``k3.transport.leakcheck.LeakCheck``: ``memory_allocated`` back within 1 MiB of the baseline, no exported
storage alive, no new shared-memory segment). A last run plants a leak (the producer keeps every bucket) and
must be caught at its first sync.

Anchor, measured in the same process: a device-to-device copy of the chunk's bytes. Bandwidth counts bytes
read plus written for both: the copy moves ``2 · chunk bytes``; a sync moves the chunk through two copies (into
the bucket, out of it), ``4 · chunk bytes``, so ``hand-off GB/s = 4 · chunk bytes / sync time`` and the goal is
>= 50% of the copy's GB/s, i.e. a sync within four copy times (two copies plus at most as much again of
latency). Sessions before 2026-12-03 counted ``2 · chunk bytes`` for the hand-off (no read+write), which halved
its ratio; ``chunk_gb_per_s`` (chunk bytes delivered per second) is reported as well.

Where a sync's time goes: ``stage`` (the copy into the bucket: on CUDA only enqueued, since ordering is by
event), ``send`` (pickling the header and, for a fresh bucket, its IPC handle; the pipe write), ``to receiver``
(the pipe, unpickling, opening a handle, up to the receiver's ``receive``), ``receiver`` (its checks, the copy
out, which first waits for the stage copy on the device, and the stream sync: ``Ack.receive_s``), ``ack back``
(the ack's way back and the producer reading it), ``release`` and ``drain``.

With the persistent buffer on CUDA the receiver acks as soon as its copy out is enqueued (it records an
interprocess event behind it, which the producer's next write into the buffer waits on), so its copy runs while
the ack travels back; a sync is timed until that copy has finished (``drain``: the producer waits for the
receiver's event on the host), so it still covers both copies. ``receiver`` is then the enqueueing only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench folder: measure.py
from measure import report  # noqa: E402

from k3.lora.export import AdapterChunk
from k3.transport.handoff import producer as producer_module
from k3.transport.handoff import (
    AdapterProducer,
    AdapterReceiver,
    TransferBuffer,
    spawn_receiver,
)
from k3.transport.leakcheck import LeakCheck

GOAL_RATIO = 0.5
# The fresh-bucket path's copy and sync, as the producer's module calls them (timed by _instrument)
_FLATTEN_INTO, _SYNC_DEVICE = producer_module.flatten_into, producer_module.sync_device
_MiB = 1 << 20


def expert_chunk_shapes(E: int, Fi: int, Lt: int, r: int, layer: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """The routed-expert chunk's PEFT names and shapes (``k3.lora.export`` module docstring)."""
    p = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
    return [
        (p + "w1.lora_A.weight", (1, r, Lt)), (p + "w1.lora_B.weight", (E, Fi, r)),
        (p + "w3.lora_A.weight", (1, r, Lt)), (p + "w3.lora_B.weight", (E, Fi, r)),
        (p + "w2.lora_A.weight", (E, r, Fi)), (p + "w2.lora_B.weight", (1, Lt, r)),
    ]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_anchor(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one device-to-device copy of ``nbytes`` (torch ``copy_``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times)


class PhaseTimer:
    """Split of each sync's time (ms) into the module docstring's phases: the producer's calls are timed here,
    the receiver's part is cut out of the ``wait ack`` time with the ack's ``received_at`` / ``receive_s``."""

    PHASES = ("stage", "send", "to receiver", "receiver", "ack back", "release", "drain")

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.per_sync: list[dict[str, float]] = []
        self.send_done = 0.0

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, t0, time.perf_counter())
        return timed

    def add(self, phase: str, start: float, end: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + 1e3 * (end - start)

    def wrap_send(self, fn):
        timed = self.wrap("send", fn)

        def send(*args, **kwargs):
            try:
                return timed(*args, **kwargs)
            finally:
                self.send_done = time.perf_counter()
        return send

    def wrap_wait_ack(self, fn):
        def wait_ack(*args, **kwargs):
            ack = fn(*args, **kwargs)
            done = time.perf_counter()
            self.add("to receiver", self.send_done, ack.received_at)
            self.add("receiver", ack.received_at, ack.received_at + ack.receive_s)
            self.add("ack back", ack.received_at + ack.receive_s, done)
            return ack
        return wait_ack

    def end_sync(self) -> None:
        self.per_sync.append(self.current)
        self.current = {}

    def medians(self) -> dict[str, float]:
        return {p: statistics.median(s.get(p, 0.0) for s in self.per_sync) for p in self.PHASES}


class _TimedConn:
    """The producer's connection with ``send`` timed (everything else passes through)."""

    def __init__(self, conn, timer: PhaseTimer) -> None:
        self._conn = conn
        self.send = timer.wrap_send(conn.send)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def _instrument(producer: AdapterProducer, timer: PhaseTimer) -> None:
    producer.conn = _TimedConn(producer.conn, timer)
    producer._wait_ack = timer.wrap_wait_ack(producer._wait_ack)
    producer._release = timer.wrap("release", producer._release)
    if producer.transfer_buffer is not None:
        producer.transfer_buffer.stage = timer.wrap("stage", producer.transfer_buffer.stage)
    else:  # the fresh-bucket path stages inline: time its copy (and a sync, where one is made)
        producer_module.flatten_into = timer.wrap("stage", _FLATTEN_INTO)
        producer_module.sync_device = timer.wrap("stage", _SYNC_DEVICE)


def run_mode(shapes, tensors, device: torch.device, syncs: int, buffered: bool, leak: bool = False) -> dict:
    """One receiver process, ``syncs`` gated syncs after a warm-up; ``leak`` keeps every fresh bucket alive."""
    expected = dict(shapes)
    make_receiver = functools.partial(AdapterReceiver, expected=expected, device=str(device), digest=False)
    proc, conn = spawn_receiver(make_receiver)
    gate = LeakCheck(device=device if device.type == "cuda" else None)
    kept: list[torch.Tensor] = []

    def on_bucket(bucket: torch.Tensor) -> None:
        gate.track(bucket)
        if leak:
            kept.append(bucket)  # the planted leak: a reference the producer should not hold

    buffer = TransferBuffer(device, torch.bfloat16) if buffered else None
    producer = AdapterProducer(conn, transfer_buffer=buffer, ack_timeout_s=300, on_bucket=on_bucket)
    timer = PhaseTimer()
    _instrument(producer, timer)
    drain = timer.wrap("drain", TransferBuffer.wait_consumed)
    names = [n for n, _ in shapes]
    times, problems_per_sync = [], []
    try:
        for v in range(1, syncs + 2):
            chunk = AdapterChunk(list(zip(names, tensors)), v, True, True)
            if v == 2:
                gate.set_baseline()
            sync_device(device)
            t0 = time.perf_counter()
            ack = producer.send_version([chunk])
            sync_device(device)
            if buffer is not None:  # the receiver acks before its copy has run: the sync ends when it has
                drain(buffer)
            dt = time.perf_counter() - t0
            del chunk
            if not (ack.ok and ack.active_version == v):
                raise RuntimeError(f"sync {v}: receiver answered {ack}")
            if v >= 2:
                times.append(dt)
                timer.end_sync()
                problems_per_sync.append(gate.end_sync())
            else:
                timer.current = {}
        report = gate.report()
        base = gate.baseline
        if device.type == "cuda":
            excess = [s.cuda_allocated_bytes - base.cuda_allocated_bytes for s in gate.samples]
            reserved_growth = gate.samples[-1].cuda_reserved_bytes - base.cuda_reserved_bytes
        else:
            excess = [s.rss_bytes - base.rss_bytes for s in gate.samples]
            reserved_growth = 0
        return {
            "mode": ("persistent transfer buffer" if buffered else "fresh bucket per chunk") + (
                ", planted leak" if leak else ""),
            "syncs": len(times), "sync_ms_median": 1e3 * statistics.median(times), "sync_ms_min": 1e3 * min(times),
            "sync_ms_max": 1e3 * max(times), "phases_ms_median": timer.medians(),
            "max_excess_after_sync_mib": max(excess) / _MiB, "reserved_growth_mib": reserved_growth / _MiB,
            "buffer_mib": (buffer.capacity * 2 / _MiB) if buffer is not None else 0.0,
            "gate_ok": report.ok, "first_bad_sync": report.first_bad_sync,
            "gate_report": str(report).splitlines()[:6],
            "syncs_with_problems": sum(1 for p in problems_per_sync if p),
        }
    finally:
        producer_module.flatten_into, producer_module.sync_device = _FLATTEN_INTO, _SYNC_DEVICE
        kept.clear()
        producer.close()
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.ipc_collect()


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = expert_chunk_shapes(args.experts, args.width, args.latent, args.rank)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(s, generator=gen, device=device).to(torch.bfloat16) * 0.01 for _, s in shapes]
    nbytes = sum(t.numel() * 2 for t in tensors)
    t_copy = copy_anchor(nbytes, device, args.copy_repeats)
    copy_gbs = 2 * nbytes / t_copy / 1e9  # read + write
    rows = []
    for buffered in (False, True):
        try:  # one mode failing on a lease must not cost the other mode's numbers
            r = run_mode(shapes, tensors, device, args.syncs, buffered)
        except Exception as e:  # noqa: BLE001 - recorded as that mode's row
            mode = "persistent transfer buffer" if buffered else "fresh bucket per chunk"
            rows.append({"mode": mode, "failed": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"  {mode}: failed: {e!r}", file=sys.stderr, flush=True)
            continue
        t_sync = r["sync_ms_median"] * 1e-3
        handoff_gbs = 4 * nbytes / t_sync / 1e9  # two copies, each read + write
        r.update({"chunk_gb_per_s": nbytes / t_sync / 1e9, "handoff_gb_per_s": handoff_gbs,
                  "sync_in_copy_times": t_sync / t_copy,
                  "ratio_to_d2d_copy": handoff_gbs / copy_gbs, "goal": GOAL_RATIO,
                  "meets_goal": handoff_gbs / copy_gbs >= GOAL_RATIO})
        rows.append(r)
        print(f"  {r['mode']}: {r['sync_ms_median']:.2f} ms/sync, gate ok {r['gate_ok']}", file=sys.stderr, flush=True)
    leak = run_mode(shapes, tensors, device, args.leak_syncs, buffered=False, leak=True)
    leak["caught"] = (not leak["gate_ok"]) and leak["first_bad_sync"] == 0
    return {
        "bench": "gpu_ipc",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "chunk": {"experts": args.experts, "width": args.width, "latent": args.latent, "rank": args.rank,
                  "tensors": len(shapes), "mib": nbytes / _MiB},
        "d2d_copy": {"ms": t_copy * 1e3, "gb_per_s_read_plus_write": copy_gbs},
        "rows": rows, "planted_leak": leak,
        "command": "python bench/gpu_ipc.py " + " ".join(sys.argv[1:]),
    }


def markdown(result: dict) -> str:
    c, d = result["chunk"], result["d2d_copy"]
    lines = [(f"# Routed-expert chunk hand-off between two processes on {result['device']} (torch {result['torch']}): "
              f"{c['experts']} experts, r={c['rank']}, {c['mib']:.1f} MiB BF16; D2D copy of the same bytes "
              f"{d['ms']:.3f} ms = {d['gb_per_s_read_plus_write']:.0f} GB/s (read+write)"), "",
             ("| mode | syncs | sync ms (median) | min | max | copy times | hand-off GB/s (2 copies, r+w) | "
              "vs D2D copy | goal >= 50% | max excess after sync MiB | gate |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"| {r['mode']} | failed: {r['failed']} | | | | | | | | | |")
            continue
        gate = "PASS" if r["gate_ok"] else f"FAIL at sync {r['first_bad_sync']}"
        lines.append(f"| {r['mode']} | {r['syncs']} | {r['sync_ms_median']:.2f} | {r['sync_ms_min']:.2f} | "
                     f"{r['sync_ms_max']:.2f} | {r['sync_in_copy_times']:.2f} | {r['handoff_gb_per_s']:.0f} | "
                     f"{100 * r['ratio_to_d2d_copy']:.0f}% | "
                     f"{'yes' if r['meets_goal'] else 'NO'} | {r['max_excess_after_sync_mib']:.3f} | {gate} |")
    lines += ["", "Where a sync's time goes (median ms per phase; the receiver's stamps are from its own process): " + "; ".join(
        f"{r['mode']}: " + ", ".join(f"{p} {ms:.3f}" for p, ms in r["phases_ms_median"].items())
        for r in result["rows"] if "failed" not in r)]
    leak = result["planted_leak"]
    lines += ["", (f"planted leak (producer keeps every bucket, {leak['syncs']} syncs): "
              f"{'caught at sync 0' if leak['caught'] else 'NOT caught as expected'}; "
              f"max excess {leak['max_excess_after_sync_mib']:.1f} MiB; gate: {leak['gate_report'][0]}")]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--syncs", type=int, default=100, help="gated syncs per mode after one warm-up")
    ap.add_argument("--leak-syncs", type=int, default=3)
    ap.add_argument("--copy-repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = run(args)
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    main()
