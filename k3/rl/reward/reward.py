"""Rule-based rewards of the recipe: ``deepscaler`` (normal mode), ``math`` (gsm8k), ``deterministic_random``.

``deepscaler`` grades only the answer region of a response: the text after the last
``<|open|>response<|sep|>`` (K3's response channel), else after the last ``</think>``, else after the first
``###Response`` (up to a second one); with none of them the reward is 0 — a response that never leaves its
think channel is not credited. In that region the last ``\\boxed{…}`` (braces nested) is the answer. The
label is used as-is, or its own boxed content when it contains ``\\boxed``. The answer is right when the two
agree after the classic MATH (Hendrycks) string normalisation, or when math-verify finds them equivalent.
As in the reference grader only ``\\boxed{`` counts: ``\\fbox{…}``, ``\\boxed 5`` and an unclosed box give 0.

``math`` is the same grading applied to the whole response (no region). ``deterministic_random`` is an
infrastructure signal: bit 0 of the first byte of SHA-256(tokens, response).

math-verify runs in a child process with a hard deadline (:mod:`k3.rl.reward.math_verify_worker`), so every reward
function here may be called from any thread and returns within a bounded time on any input.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Protocol

from k3.rl.reward.math_verify_worker import MathVerifyWorker, default_worker

RESPONSE_MARKER = "<|open|>response<|sep|>"
THINK_END = "</think>"
RESPONSE_HEADER = "###Response"
BOXED = "\\boxed"


class RewardFn(Protocol):
    def __call__(self, response: str, label: str, *, tokens: Sequence[int] | None = None) -> float: ...


# ---------------------------------------------------------------------------------------------------------
# Answer extraction


def answer_region(response: str) -> str | None:
    """The part of ``response`` the deepscaler reward grades, or None when no marker is present."""
    if RESPONSE_MARKER in response:
        return response.rsplit(RESPONSE_MARKER, 1)[1]
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if RESPONSE_HEADER in response:
        return response.split(RESPONSE_HEADER)[1]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` in ``text`` (nested braces kept), or None.

    The last ``\\boxed`` decides: if it is not directly followed by a balanced ``{…}`` the result is None,
    even when an earlier box is well formed (the model's final answer is malformed, so it is not credited).
    """
    start = text.rfind(BOXED)
    if start < 0:
        return None
    i = start + len(BOXED)
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def label_answer(label: str | int | float) -> str | None:
    """The ground-truth answer of a dataset label: its boxed content if it has a box, else the label itself."""
    text = str(label).strip()
    if BOXED in text:
        return last_boxed(text)
    return text or None


# ---------------------------------------------------------------------------------------------------------
# MATH string normalisation (the rules of the Hendrycks MATH grader, implemented here)

_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<inner>.+)\}$", re.DOTALL)
_SLASH_FRACTION = re.compile(r"^(-?\d+)/(-?\d+)$")


def _fix_sqrt(s: str) -> str:
    # \sqrt3 -> \sqrt{3}: a one-character radicand without braces.
    return re.sub(r"\\sqrt\s*([^{\\\s])", r"\\sqrt{\1}", s)


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}; a braced numerator is left alone.
    parts = s.split("\\frac")
    out = [parts[0]]
    for rest in parts[1:]:
        out.append("\\frac")
        if rest.startswith("{"):
            out.append(rest)
            continue
        if len(rest) < 2:
            return s  # "\frac" with fewer than two characters after it: not a fraction we can repair
        num, den, tail = rest[0], rest[1], rest[2:]
        out.append("{" + num + "}" + (den + tail if den == "{" else "{" + den + "}" + tail))
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    # "3/4" -> \frac{3}{4}, only for two plain integers written canonically.
    m = _SLASH_FRACTION.match(s)
    if m is None or s != f"{int(m.group(1))}/{int(m.group(2))}":
        return s
    return "\\frac{" + m.group(1) + "}{" + m.group(2) + "}"


def normalize_math_answer(answer: str) -> str:
    """The MATH-style canonical form of an answer string (used for an exact-match check)."""
    s = answer.strip()
    m = _TEXT_WRAPPED.match(s)
    if m is not None:
        s = m.group("inner").strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # "\text{ cm}" style: a unit on the right
        s = s.split("\\text{ ", 1)[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs_rhs = s.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:  # "x = 3", "k=3": drop a short variable name
        s = lhs_rhs[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


_INTEGER = re.compile(r"^[+-]?(\d+|\d{1,3}(,\d{3})+)$")


def _as_integer(s: str) -> int | None:
    return int(s.replace(",", "")) if _INTEGER.match(s) else None


def answers_match(given: str, truth: str, *, verifier: MathVerifyWorker | None = None) -> bool:
    """Whether ``given`` is a correct answer for ground truth ``truth``.

    MATH normalisation match, else — when both are plain integers — integer equality (math-verify would say
    the same, this just skips the child process), else math-verify equivalence (``verify(truth, given)``).
    """
    g, t = normalize_math_answer(given), normalize_math_answer(truth)
    if g == t:
        return True
    if not g or not t:
        return False
    gi, ti = _as_integer(g), _as_integer(t)
    if gi is not None and ti is not None:
        return gi == ti
    return (verifier or default_worker()).equivalent(truth, given)


# ---------------------------------------------------------------------------------------------------------
# Reward functions


def _grade_boxed(text: str, label: str | int | float, verifier: MathVerifyWorker | None) -> float:
    given = last_boxed(text)
    truth = label_answer(label)
    if given is None or truth is None:
        return 0.0
    return 1.0 if answers_match(given, truth, verifier=verifier) else 0.0


def deepscaler_reward(
    response: str,
    label: str | int | float,
    *,
    tokens: Sequence[int] | None = None,
    verifier: MathVerifyWorker | None = None,
) -> float:
    """1.0 if the boxed answer in the response's answer region matches the label, else 0.0."""
    region = answer_region(response)
    if region is None:
        return 0.0
    return _grade_boxed(region, label, verifier)


def math_reward(
    response: str,
    label: str | int | float,
    *,
    tokens: Sequence[int] | None = None,
    verifier: MathVerifyWorker | None = None,
) -> float:
    """1.0 if the last boxed answer anywhere in the response matches the label, else 0.0."""
    return _grade_boxed(response, label, verifier)


def deterministic_random_reward(
    response: str,
    label: str | int | float,
    *,
    tokens: Sequence[int] | None = None,
    verifier: MathVerifyWorker | None = None,
) -> float:
    """0.0 or 1.0 from SHA-256 over the sample's token ids and response text (first byte mod 2)."""
    h = hashlib.sha256()
    h.update(json.dumps([int(t) for t in tokens or []]).encode())
    h.update(response.encode("utf-8"))
    return float(h.digest()[0] % 2)


REWARD_FNS: dict[str, Callable[..., float]] = {
    "deepscaler": deepscaler_reward,
    "math": math_reward,
    "deterministic_random": deterministic_random_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under ``name`` (``deepscaler``, ``math``, ``deterministic_random``)."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise ValueError(f"unknown reward model {name!r}; expected one of {sorted(REWARD_FNS)}") from None


def default_reward_name(task: str, mode: str) -> str:
    """The recipe's ``--reward-model`` default: ``math`` for gsm8k; for dapo-math ``deterministic_random`` in
    ``debug_minimal`` and ``deepscaler`` in ``normal``; the generated ``arith`` task uses ``deepscaler``."""
    if task == "gsm8k":
        return "math"
    if task == "arith":
        return "deepscaler"
    if task == "dapo-math":
        if mode not in ("debug_minimal", "normal"):
            raise ValueError(f"unknown mode {mode!r}; expected 'debug_minimal' or 'normal'")
        return "deterministic_random" if mode == "debug_minimal" else "deepscaler"
    raise ValueError(f"unknown task {task!r}; expected 'dapo-math', 'gsm8k' or 'arith'")
