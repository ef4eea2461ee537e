"""Supervised warm-up of a small base model on a generated corpus, so RL starts from a policy that partly
solves its task (the smoke's tiny K3 knows nothing at random init). Full-parameter AdamW on the completion
tokens only; the result is saved as a BF16 HF checkpoint and cached by a key of everything that shapes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from k3.model import KimiK3ForCausalLM
from k3.rl.grpo import token_log_probs
from k3.tokenizer import load_tokenizer


def warmup_key(base_dir: str | Path, **settings: object) -> str:
    """Cache key: the base checkpoint's config, index and weight bytes, and the warm-up settings.

    The weights count, not just their index: a base with the same names and shapes but other values (another
    seed, or a change in how synthetic checkpoints are generated) must not reuse a stale warm-up. The bases warmed
    up are small (the smoke's tiny model, a few MB), so reading them whole costs nothing.
    """
    h = hashlib.sha256()
    base = Path(base_dir)
    for name in ("config.json", "model.safetensors.index.json"):
        p = base / name
        if p.exists():
            h.update(p.read_bytes())
    for p in sorted(base.glob("*.safetensors")):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def supervised_warmup(
    base_dir: str | Path,
    out_dir: str | Path,
    examples: list[tuple[str, str]],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    time_budget_s: float | None = None,
    label_smoothing: float = 0.0,
) -> dict[str, float]:
    """Train ``base_dir``'s model on ``(prompt, completion)`` texts and save it to ``out_dir`` (atomic).

    Loss = mean NLL of the completion tokens, with ``label_smoothing`` ε mixing in the mean NLL over the
    vocabulary (keeps the policy's entropy above zero, so RL still has samples to compare). Stops after ``steps`` or ``time_budget_s`` seconds. Returns
    ``{"steps", "loss_first", "loss_last", "seconds"}``.
    """
    torch.manual_seed(seed)
    tok = load_tokenizer(base_dir)
    model = KimiK3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    enc = [(tok.encode(p, allow_special=True), tok.encode(c, allow_special=True)) for p, c in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    first = last = float("nan")
    done = 0
    for step in tqdm(range(steps), desc="warm-up", unit="step", disable=None):
        idx = torch.randint(len(enc), (batch_size,), generator=g).tolist()
        batch = [enc[i] for i in idx]
        S = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((batch_size, S), tok.pad_id, dtype=torch.long)
        mask = torch.zeros((batch_size, S - 1), dtype=torch.bool)
        for b, (p, c) in enumerate(batch):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            mask[b, len(p) - 1 : len(p) + len(c) - 1] = True
        logits = model(ids)[:, :-1]
        logp = token_log_probs(logits, ids[:, 1:])
        nll = -(logp * mask).sum() / mask.sum()
        if label_smoothing > 0:
            uniform = -(torch.log_softmax(logits.float(), -1).mean(-1) * mask).sum() / mask.sum()
            loss = (1 - label_smoothing) * nll + label_smoothing * uniform
        else:
            loss = nll
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = float(nll.detach())
        first = last if step == 0 else first
        done = step + 1
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, dtype=torch.bfloat16)
    for extra in Path(base_dir).iterdir():  # tokenizer and other side files travel with the weights
        if extra.is_file() and not extra.name.endswith(".safetensors") and not (tmp / extra.name).exists():
            shutil.copy2(extra, tmp / extra.name)
    stats = {"steps": done, "loss_first": first, "loss_last": last, "seconds": time.perf_counter() - t0}
    (tmp / "warmup.json").write_text(json.dumps(stats, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return stats
