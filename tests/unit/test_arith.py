import json

import pytest

from k3.rl.data.arith import (
    ArithConfig,
    Problem,
    is_eval_problem,
    sample_problems,
    warmup_corpus,
    warmup_example,
    write_arith_dataset,
    write_warmup_corpus,
)
from k3.rl.data.chat import encode_prompt
from k3.rl.data.records import read_records
from k3.rl.reward.reward import deepscaler_reward
from k3.tokenizer import ByteTokenizer


def test_problems_are_deterministic_per_seed():
    a = sample_problems("train", 200, seed=7)
    assert a == sample_problems("train", 200, seed=7)
    assert a != sample_problems("train", 200, seed=8)
    assert sample_problems("eval", 50, seed=1) == sample_problems("eval", 50, seed=1)


def test_splits_are_disjoint_and_eval_is_distinct():
    train = {p.expression for p in sample_problems("train", 3000, seed=0)}
    ev = sample_problems("eval", 200, seed=0)
    assert len({p.expression for p in ev}) == 200
    assert train.isdisjoint(p.expression for p in ev)
    assert all(is_eval_problem(p) for p in ev) and not any(is_eval_problem(p) for p in sample_problems("train", 300))
    # the split is a property of the problem: another seed's eval set never meets this seed's train set
    assert train.isdisjoint(p.expression for p in sample_problems("eval", 200, seed=99))


def test_labels_and_operand_ranges():
    probs = sample_problems("train", 2000, seed=0, config=ArithConfig(b_max=None))
    for p in probs:
        assert p.answer == eval(p.expression)
        assert p.record() == {"prompt": f"What is {p.a} {p.op} {p.b}?", "label": str(p.answer)}
        assert 0 <= p.a <= 99 and 0 <= p.b <= 99 and p.op in "+-" and p.answer >= 0
    one_digit = sum(p.a < 10 and p.b < 10 for p in probs)
    two_digit = sum(p.a >= 10 and p.b >= 10 for p in probs)
    assert 300 < one_digit < 700 and 300 < two_digit < 700  # digits (1, 2) drawn per operand: ~1/4 each
    small = sample_problems("train", 500, seed=0)  # the default: a small addend, 0..b_max
    assert all(0 <= p.b <= 9 for p in small) and any(p.a >= 10 for p in small)


def test_boxed_share_mixes_answer_forms():
    from k3.rl.data.arith import warmup_corpus

    corpus = warmup_corpus(400, seed=0, config=ArithConfig(boxed_share=0.5))
    boxed = sum("\\boxed{" in ex.completion for ex in corpus)
    assert 150 < boxed < 250
    assert all("\\boxed{" in ex.completion for ex in warmup_corpus(50, seed=0))


def test_difficulty_is_tunable():
    easy = sample_problems("train", 300, config=ArithConfig(digits=(1,), ops=("+",)))
    assert all(p.a < 10 and p.b < 10 and p.op == "+" for p in easy)
    hard = sample_problems("train", 300, config=ArithConfig(digits=(3,), ops=("-", "*"), allow_negative=True, b_max=None))
    assert all(100 <= p.a <= 999 and 100 <= p.b <= 999 for p in hard)
    assert any(p.answer < 0 for p in hard) and any(p.op == "*" for p in hard)


def test_bad_configs_and_impossible_requests():
    with pytest.raises(ValueError, match="digits"):
        ArithConfig(digits=())
    with pytest.raises(ValueError, match="ops"):
        ArithConfig(ops=("/",))
    with pytest.raises(ValueError, match="eval_per_mille"):
        ArithConfig(eval_per_mille=0)
    with pytest.raises(ValueError, match="think"):
        ArithConfig(think="long")
    with pytest.raises(ValueError, match="split"):
        sample_problems("test", 1)
    # 1-digit addition has 100 problems; ~10 are held out, so 50 distinct eval problems do not exist
    with pytest.raises(ValueError, match="could not draw 50 distinct eval problems"):
        sample_problems("eval", 50, config=ArithConfig(digits=(1,), ops=("+",)))


def test_dataset_files_are_dapo_records(tmp_path):
    train, ev = write_arith_dataset(tmp_path, n_train=64, n_eval=16, seed=2)
    assert (train.name, ev.name) == ("train.jsonl", "eval.jsonl")
    recs = read_records(train)
    assert len(recs) == 64 and len(read_records(ev)) == 16
    assert recs[0] == sample_problems("train", 1, seed=2)[0].record()


def test_warmup_conversation_format_exactly():
    ex = warmup_example(Problem(17, "+", 25))
    assert ex.prompt == (
        '<|open|>message role="user"<|sep|>What is 17 + 25?<|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert ex.completion == "17 + 25 = 42<|close|>think<|sep|><|open|>response<|sep|>\\boxed{42}<|end_of_msg|>"
    assert warmup_example(Problem(3, "-", 1), ArithConfig(think="none")).completion.startswith("<|close|>think")


def test_warmup_completions_earn_the_deepscaler_reward():
    corpus = warmup_corpus(100, seed=0)
    for ex in corpus:
        assert deepscaler_reward(ex.completion, str(ex.problem.answer)) == 1.0
        assert deepscaler_reward(ex.completion, str(ex.problem.answer + 1)) == 0.0
    assert not any(is_eval_problem(ex.problem) for ex in warmup_corpus(2000, seed=0))


def test_warmup_sequences_are_short_for_the_byte_tokenizer(tmp_path):
    tok = ByteTokenizer()
    for ex in warmup_corpus(200, seed=0):
        ids = tok.encode(ex.text)
        assert len(ids) <= 113 and ids[-1] == tok.eos_id  # 71 prompt + 42 completion at "99 + 99"
        assert tok.encode(ex.prompt) == encode_prompt(tok, ex.problem.prompt)
    path = write_warmup_corpus(tmp_path / "warmup.jsonl", 10, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"prompt": ex.prompt, "completion": ex.completion} for ex in warmup_corpus(10, seed=0)]
