"""``megatron_compat.run_workers``, the launcher of the multi-process tests: a worker that runs out of its time is
killed and its output is in the error, so a GPU run that spent its limit autotuning still says where the time went."""

from __future__ import annotations

import pytest
from megatron_compat import _text, run_workers


def test_a_worker_past_its_timeout_is_killed_and_its_output_kept(tmp_path):
    script = tmp_path / "slow_worker.py"
    script.write_text("import sys, time\nprint('autotuning kernel A', flush=True)\n"
                      "print('on stderr', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    with pytest.raises(AssertionError, match=r"(?s)ran past 2 s and was killed:\n.*autotuning kernel A.*on stderr"):
        run_workers([str(script)], timeout=2.0)


def test_a_failing_worker_reports_its_exit_code_and_output(tmp_path):
    script = tmp_path / "failing_worker.py"
    script.write_text("print('before the error')\nraise SystemExit(3)\n")
    with pytest.raises(AssertionError, match=r"(?s)exited with 3:\n.*before the error"):
        run_workers([str(script)], timeout=30.0)


@pytest.mark.parametrize("output, text", [(None, ""), (b"caf\xc3\xa9 \xff", "café \ufffd"), ("text", "text")])
def test_killed_output_becomes_text(output, text):
    assert _text(output) == text
