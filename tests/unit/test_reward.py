import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from k3.rl.reward.math_verify_worker import MathVerifyWorker
from k3.rl.reward.reward import (
    answer_region,
    deepscaler_reward,
    default_reward_name,
    deterministic_random_reward,
    get_reward_fn,
    label_answer,
    last_boxed,
    math_reward,
    normalize_math_answer,
)

R = "<|open|>think<|sep|>some work<|close|>think<|sep|><|open|>response<|sep|>"  # K3's channel switch
END = "<|end_of_msg|>"


@pytest.fixture(scope="module")
def verifier():
    w = MathVerifyWorker()
    yield w
    w.close()


def boxed(ans: str) -> str:
    return R + "So the answer is \\boxed{" + ans + "}." + END


# (response, label, expected reward)
GRADED = [
    # answer region
    pytest.param(boxed("42"), "42", 1.0, id="k3-response-channel"),
    pytest.param("\\boxed{42}", "42", 0.0, id="no-marker-is-0"),
    pytest.param("<|open|>think<|sep|>so \\boxed{42}", "42", 0.0, id="never-left-think-is-0"),
    pytest.param("reasoning</think>The answer is \\boxed{42}", "42", 1.0, id="after-think-close"),
    pytest.param("a</think>\\boxed{1}</think>\\boxed{2}", "2", 1.0, id="after-last-think-close"),
    pytest.param("###Response\n\\boxed{7}", "7", 1.0, id="after-response-header"),
    pytest.param("###Response \\boxed{3} ###Response \\boxed{4}", "3", 1.0, id="response-header-first-segment"),
    pytest.param(
        "<|open|>think<|sep|>\\boxed{42}<|close|>think<|sep|><|open|>response<|sep|>it is 42",
        "42",
        0.0,
        id="box-only-in-think-is-0",
    ),
    pytest.param(R + "\\boxed{1}" + R + "\\boxed{2}", "2", 1.0, id="last-response-marker-wins"),
    pytest.param("</think>\\boxed{5}<|open|>response<|sep|>\\boxed{6}", "5", 0.0, id="marker-beats-think-close"),
    # boxes
    pytest.param(R + "\\boxed{1} then \\boxed{2}", "2", 1.0, id="several-boxes-last-wins"),
    pytest.param(R + "\\boxed{1} then \\boxed{2}", "1", 0.0, id="several-boxes-earlier-loses"),
    pytest.param(boxed("\\frac{\\sqrt{3}}{2}"), "\\frac{\\sqrt3}{2}", 1.0, id="nested-braces"),
    pytest.param(boxed("\\{1, 2\\}"), "\\{2, 1\\}", 1.0, id="escaped-braces-set"),
    pytest.param(R + "\\boxed{42", "42", 0.0, id="unclosed-box"),
    pytest.param(R + "\\fbox{42}", "42", 0.0, id="fbox-not-credited"),
    pytest.param(R + "\\boxed 42", "42", 0.0, id="box-without-braces"),
    pytest.param(R + "\\boxed{41} no wait \\boxed 42", "42", 0.0, id="malformed-last-box-decides"),
    pytest.param(R + "42", "42", 0.0, id="no-box"),
    pytest.param(R + "\\boxed{}", "42", 0.0, id="empty-box"),
    # labels
    pytest.param(boxed("42"), "\\boxed{42}", 1.0, id="label-boxed"),
    pytest.param(boxed("0.5"), "The answer is $\\boxed{\\frac{1}{2}}$", 1.0, id="label-boxed-in-text"),
    pytest.param(boxed("42"), 42, 1.0, id="label-int"),
    pytest.param(boxed("42"), "", 0.0, id="label-empty"),
    pytest.param(boxed("4"), "\\boxed{4", 0.0, id="label-broken-box"),
    # numbers
    pytest.param(boxed("0.5"), "\\frac{1}{2}", 1.0, id="decimal-vs-frac"),
    pytest.param(boxed("\\dfrac{1}{2}"), "1/2", 1.0, id="dfrac-vs-slash"),
    pytest.param(boxed("\\frac12"), "\\frac{1}{2}", 1.0, id="frac-shorthand"),
    pytest.param(boxed("3/4"), "0.75", 1.0, id="slash-vs-decimal"),
    pytest.param(boxed("2/4"), "1/2", 1.0, id="unreduced-fraction-math-verify"),
    pytest.param(boxed("1.5"), "\\frac{3}{2}", 1.0, id="decimal-vs-improper"),
    pytest.param(boxed("0.33"), "1/3", 0.0, id="rounded-decimal-is-wrong"),
    pytest.param(boxed("1,000"), "1000", 1.0, id="thousands-comma"),
    pytest.param(boxed("007"), "7", 1.0, id="leading-zeros"),
    pytest.param(boxed("3.0"), "3", 1.0, id="float-integer"),
    pytest.param(boxed("2.9999999"), "3", 0.0, id="near-integer-is-wrong"),
    pytest.param(boxed("-5"), "5", 0.0, id="sign"),
    pytest.param(boxed("41"), "42", 0.0, id="wrong-integer"),
    pytest.param(boxed("\\pi"), "3.14", 0.0, id="pi-not-3.14"),
    # LaTeX forms
    pytest.param(boxed("\\left(1, 2\\right)"), "(1,2)", 1.0, id="left-right"),
    pytest.param(boxed("90^\\circ"), "90", 1.0, id="degrees"),
    pytest.param(boxed("90^{\\circ}"), "90", 1.0, id="degrees-braced"),
    pytest.param(boxed("\\text{5}"), "5", 1.0, id="text-wrapped"),
    pytest.param(boxed("\\text{(B)}"), "B", 1.0, id="choice-letter"),
    pytest.param(boxed("B"), "C", 0.0, id="wrong-letter"),
    pytest.param(boxed("\\sqrt{2}/2"), "\\frac{\\sqrt{2}}{2}", 1.0, id="sqrt-forms"),
    pytest.param(boxed("2\\sqrt{2}"), "\\sqrt{8}", 1.0, id="sqrt-simplified"),
    pytest.param(boxed("x = 3"), "3", 1.0, id="variable-prefix"),
    pytest.param(boxed("\\$5"), "5", 1.0, id="dollar"),
    pytest.param(boxed("10\\%"), "10", 1.0, id="percent"),
    pytest.param(boxed("x^2+2x+1"), "(x+1)^2", 1.0, id="symbolic"),
    pytest.param(boxed("x+1"), "x+2", 0.0, id="symbolic-wrong"),
    # intervals and sets
    pytest.param(boxed("(1, 2]"), "(1,2]", 1.0, id="interval"),
    pytest.param(boxed("[1, 2]"), "(1,2]", 0.0, id="interval-wrong-bracket"),
    pytest.param(boxed("(-\\infty, 3)"), "(-\\infty,3)", 1.0, id="interval-infinite"),
    pytest.param(boxed("[0, \\infty)"), "[0,\\infty)", 1.0, id="interval-half-infinite"),
    pytest.param(boxed("(3,4) \\cup (1,2)"), "(1,2)\\cup(3,4)", 1.0, id="union-order"),
    # units
    pytest.param(boxed("5 \\text{ cm}"), "5", 1.0, id="unit-spaced"),
    pytest.param(boxed("5\\text{cm}"), "5", 1.0, id="unit-unspaced"),
    pytest.param(boxed("12\\text{ inches}"), "12", 1.0, id="unit-word"),
    pytest.param(boxed("\\text{five}"), "5", 0.0, id="number-word-not-parsed"),
]


@pytest.mark.parametrize("response,label,expected", GRADED)
def test_deepscaler_graded(response, label, expected, verifier):
    assert deepscaler_reward(response, label, verifier=verifier) == expected


def test_table_is_large():
    assert len(GRADED) >= 40


def test_math_reward_grades_the_whole_response(verifier):
    assert math_reward("\\boxed{42}", "42", verifier=verifier) == 1.0  # no marker needed
    assert math_reward("<|open|>think<|sep|>\\boxed{1/2}", "0.5", verifier=verifier) == 1.0
    assert math_reward("42", "42", verifier=verifier) == 0.0
    assert math_reward("\\boxed{41}", "42", verifier=verifier) == 0.0


def test_deterministic_random_is_sha256_first_byte_mod_2():
    tokens, response = [1, 2, 3], "hi"
    want = hashlib.sha256(b"[1, 2, 3]" + b"hi").digest()[0] % 2
    assert deterministic_random_reward(response, "x", tokens=tokens) == float(want)
    values = [deterministic_random_reward(f"r{i}", "x", tokens=[i]) for i in range(400)]
    assert set(values) == {0.0, 1.0} and 140 < sum(values) < 260  # a fair coin, ~200 ± 3 sigma
    assert values == [deterministic_random_reward(f"r{i}", "x", tokens=[i]) for i in range(400)]


def test_registry():
    assert get_reward_fn("deepscaler") is deepscaler_reward
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("deterministic_random") is deterministic_random_reward
    with pytest.raises(ValueError, match="unknown reward model 'dapo'.*deepscaler"):
        get_reward_fn("dapo")
    assert default_reward_name("gsm8k", "normal") == "math"
    assert default_reward_name("dapo-math", "normal") == "deepscaler"
    assert default_reward_name("dapo-math", "debug_minimal") == "deterministic_random"
    with pytest.raises(ValueError, match="unknown task"):
        default_reward_name("mmlu", "normal")


def test_extraction_helpers():
    assert answer_region("x") is None
    assert answer_region(R + "tail") == "tail"
    assert last_boxed("\\boxed{a{b}c} \\boxed{d}") == "d"
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("\\boxed{a{b}c") is None
    assert label_answer(" 7 ") == "7" and label_answer(7.5) == "7.5" and label_answer("") is None


@pytest.mark.parametrize(
    "raw,normal",
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac{1}{2}"),
        ("3/4", "\\frac{3}{4}"),
        ("03/4", "03/4"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("\\sqrt 3", "\\sqrt{3}"),
        ("k = 7", "7"),
        ("abc = 7", "abc=7"),
        ("\\text{ hello }", "hello"),
        ("5 \\text{ cm}", "5"),
        ("90^\\circ", "90"),
        ("\\left( 1,2 \\right)", "(1,2)"),
        ("10\\%", "10"),
        ("\\$5", "5"),
        ("1\n2", "12"),
        ("", ""),
    ],
)
def test_math_normaliser(raw, normal):
    assert normalize_math_answer(raw) == normal


def test_math_verify_itself_refuses_threads():
    # Why the worker exists: math-verify's signal timeouts raise off the main thread.
    from math_verify import parse

    errors = []

    def call():
        try:
            parse("$1/2$")
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert errors and "thread" in errors[0]


def test_rewards_off_the_main_thread(verifier):
    cases = [
        (boxed("0.5"), "1/2", 1.0),
        (boxed("(1, 2]"), "(1,2]", 1.0),
        (boxed("x+1"), "x+2", 0.0),
        (boxed("2\\sqrt{2}"), "\\sqrt{8}", 1.0),
    ] * 3
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda c: deepscaler_reward(c[0], c[1], verifier=verifier), cases))
    assert got == [c[2] for c in cases]


PATHOLOGICAL = "9^{9^{9}}"  # sympy works on this for minutes


def test_hard_deadline_kills_a_stuck_worker_and_recovers():
    w = MathVerifyWorker(timeout_s=1.0, soft_timeout_s=60)  # math-verify's own alarm would come far too late
    try:
        assert w.equivalent("1/2", "0.5") is True
        first_pid = w.pid
        t = time.monotonic()
        assert w.equivalent("1", PATHOLOGICAL) is False
        assert time.monotonic() - t < 3.0
        assert w.restarts == 1 and w.pid is None
        assert w.equivalent("3", "\\frac{6}{2}") is True  # a fresh child answers the next call
        assert w.pid not in (None, first_pid)
    finally:
        w.close()


def test_soft_timeout_keeps_the_worker():
    w = MathVerifyWorker(timeout_s=30.0, soft_timeout_s=1)
    try:
        assert w.equivalent("1", "1.0") is True
        pid = w.pid
        t = time.monotonic()
        assert w.equivalent("1", PATHOLOGICAL) is False
        assert time.monotonic() - t < 10.0
        assert w.restarts == 0 and w.pid == pid
    finally:
        w.close()


def test_worker_rejects_bad_settings():
    with pytest.raises(ValueError, match="timeout"):
        MathVerifyWorker(timeout_s=0)
    with pytest.raises(ValueError, match="soft_timeout"):
        MathVerifyWorker(soft_timeout_s=0)
