"""The smoke's generated task: integer arithmetic in the dapo-math record format, and a warm-up corpus.

Problems are ``What is 17 + 25?`` with label ``"42"``. Which problems are held out for eval is decided by a hash
of the problem itself (not by the seed or the sample counts), so the train and eval splits are disjoint for any
seed and size. Difficulty is set by the operand digit counts and the operators: the default mixes one- and
two-digit addition and subtraction, which a tiny model warmed up briefly solves in part — the easy ones first —
leaving RL a reward strictly between 0 and 1 to climb.

The warm-up corpus holds whole XTML conversations whose assistant turn is
``<|open|>think<|sep|>17 + 25 = 42<|close|>think<|sep|><|open|>response<|sep|>\\boxed{42}<|end_of_msg|>``, drawn
from the train split only, so the model learns the format the deepscaler reward parses.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from k3.rl.data.chat import assistant_completion, build_prompt
from k3.rl.data.records import write_records

OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithConfig:
    """What problems look like.

    digits: operand digit counts, each operand's drawn uniformly from these (1 → 0..9, 2 → 10..99, …).
    ops: operators drawn uniformly. allow_negative: if False, ``a - b`` has a >= b.
    eval_per_mille: share of the problem space held out for eval, in thousandths.
    think: the warm-up think channel: "equation" (``17 + 25 = 42``) or "none" (empty).
    """

    digits: tuple[int, ...] = (1, 2)
    ops: tuple[str, ...] = ("+",)
    allow_negative: bool = False
    eval_per_mille: int = 200
    think: str = "equation"
    # Second operand drawn from 0..b_max instead of by ``digits`` (None: by digits). A small addend makes
    # held-out problems compositions of facts the model has seen (last-digit sum + carry), so they generalise.
    b_max: int | None = 9
    # Share of warm-up completions whose answer is \boxed{} (the graded form); the rest give it bare. Below 1
    # the base only partly follows the answer format, and RL has to learn it from the reward alone.
    boxed_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.digits or any(not 1 <= d <= 6 for d in self.digits):
            raise ValueError(f"digits must be a non-empty tuple of 1..6, got {self.digits}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {self.ops}")
        if not 0 < self.eval_per_mille < 1000:
            raise ValueError(f"eval_per_mille must be in 1..999, got {self.eval_per_mille}")
        if self.b_max is not None and self.b_max < 0:
            raise ValueError(f"b_max must be >= 0, got {self.b_max}")
        if not 0 <= self.boxed_share <= 1:
            raise ValueError(f"boxed_share must be in [0, 1], got {self.boxed_share}")
        if self.think not in ("equation", "none"):
            raise ValueError(f"think must be 'equation' or 'none', got {self.think!r}")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def prompt(self) -> str:
        return f"What is {self.expression}?"

    def record(self) -> dict:
        """The dapo-math-style record: ``{"prompt", "label"}``."""
        return {"prompt": self.prompt, "label": str(self.answer)}


def is_eval_problem(p: Problem, config: ArithConfig = ArithConfig()) -> bool:
    """Whether ``p`` belongs to the held-out eval split (a property of the problem alone)."""
    h = int.from_bytes(hashlib.sha256(p.expression.encode()).digest()[:8], "big")
    return h % 1000 < config.eval_per_mille


def _operand(rng: random.Random, digits: int) -> int:
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10**digits - 1)


def _draw(rng: random.Random, config: ArithConfig) -> Problem:
    a = _operand(rng, rng.choice(config.digits))
    b = rng.randint(0, config.b_max) if config.b_max is not None else _operand(rng, rng.choice(config.digits))
    op = rng.choice(config.ops)
    if op == "-" and not config.allow_negative and a < b:
        a, b = b, a
    return Problem(a, op, b)


def sample_problems(
    split: str, n: int, *, seed: int = 0, config: ArithConfig = ArithConfig(), unique: bool | None = None
) -> list[Problem]:
    """``n`` problems of ``split`` ("train" or "eval"), deterministic for ``seed``.

    Eval problems are distinct (a fixed set to measure on); train problems are drawn with replacement unless
    ``unique``. Raises ValueError when the split's problem space is too small for ``n`` distinct problems.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unique = split == "eval" if unique is None else unique
    want_eval = split == "eval"
    rng = random.Random(f"k3-arith:{split}:{seed}")
    out: list[Problem] = []
    seen: set[Problem] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * n + 10_000:
            raise ValueError(
                f"could not draw {n} {'distinct ' if unique else ''}{split} problems with {config} "
                f"(found {len(out)}); use more digits or fewer problems"
            )
        p = _draw(rng, config)
        if is_eval_problem(p, config) != want_eval or (unique and p in seen):
            continue
        seen.add(p)
        out.append(p)
    return out


def write_arith_dataset(
    out_dir: str | Path, *, n_train: int = 4096, n_eval: int = 128, seed: int = 0, config: ArithConfig = ArithConfig()
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (dapo-math records) under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    train, eval_ = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    write_records(train, (p.record() for p in sample_problems("train", n_train, seed=seed, config=config)))
    write_records(eval_, (p.record() for p in sample_problems("eval", n_eval, seed=seed, config=config)))
    return train, eval_


@dataclass(frozen=True)
class WarmupExample:
    """One supervised conversation: ``prompt`` (XTML up to the generation prefix) + ``completion`` (trained on)."""

    problem: Problem
    prompt: str
    completion: str

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def warmup_example(p: Problem, config: ArithConfig = ArithConfig(), boxed: bool = True) -> WarmupExample:
    think = f"{p.expression} = {p.answer}" if config.think == "equation" else ""
    answer = f"\\boxed{{{p.answer}}}" if boxed else str(p.answer)
    return WarmupExample(p, build_prompt(p.prompt), assistant_completion(think, answer))


def warmup_corpus(n: int, *, seed: int = 0, config: ArithConfig = ArithConfig()) -> list[WarmupExample]:
    """``n`` warm-up conversations on train-split problems (never an eval problem); each one's answer is boxed
    with probability ``config.boxed_share`` (drawn per example, so a problem is seen in both forms)."""
    rng = random.Random(f"k3-arith:boxed:{seed}")
    return [warmup_example(p, config, boxed=rng.random() < config.boxed_share)
            for p in sample_problems("train", n, seed=seed + 1_000_003, config=config)]


def write_warmup_corpus(path: str | Path, n: int, *, seed: int = 0, config: ArithConfig = ArithConfig()) -> Path:
    """The warm-up corpus as jsonl ``{"prompt", "completion"}`` at ``path`` (written atomically)."""
    path = Path(path)
    corpus = warmup_corpus(n, seed=seed, config=config)
    write_records(path, ({"prompt": ex.prompt, "completion": ex.completion} for ex in corpus))
    return path
