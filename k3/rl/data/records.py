"""Prompt records: reading them (jsonl or parquet, every record validated), loading them as chat prompts for
rollouts and evals, writing them.

Every record is one JSON object per line with ``prompt`` (a string, or a list of ``{role, content}`` messages;
gsm8k's ``messages`` key is accepted for it) and ``label`` (the answer; numbers are read as strings).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from k3.rl.data.chat import ChatFormatError, as_messages

__all__ = ["PROMPT_PLACEHOLDER", "DataError", "DataFormatError", "load_prompts", "read_records", "write_records"]


class DataError(RuntimeError):
    """Data that is missing, unreachable, or malformed; the message says what to do."""


class DataFormatError(DataError):
    """Records that do not have the expected keys or types; ``problems`` holds ``file:line: reason`` lines."""

    def __init__(self, path: Path, problems: list[str], total: int) -> None:
        self.path = path
        self.problems = problems
        more = f"\n  … and {total - len(problems)} more" if total > len(problems) else ""
        super().__init__(f"{path}: {total} bad record(s):\n  " + "\n  ".join(problems) + more)


def _read_parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow, which is not installed. Install it (`pip install pyarrow`) "
            "or convert the file to jsonl with keys prompt/label and pass that instead."
        ) from None
    return pq.read_table(path).to_pylist()


def _iter_raw(path: Path) -> Iterable[tuple[str, object]]:
    """(location, parsed object or the JSONDecodeError) for each record of a jsonl or parquet file."""
    if path.suffix == ".parquet":
        for i, row in enumerate(_read_parquet_rows(path)):
            yield f"{path}:row {i}", row
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, a separator) carry no record
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", e


def _validate(obj: object, prompt_key: str, label_key: str) -> tuple[dict | None, str | None]:
    if isinstance(obj, json.JSONDecodeError):
        # json's "Unterminated string starting at" already ends in "at": not "at at column"
        return None, f"not valid JSON ({obj.msg.removesuffix(' at')} at column {obj.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    key = prompt_key if prompt_key in obj else "messages" if prompt_key == "prompt" and "messages" in obj else None
    if key is None:
        return None, f"missing key {prompt_key!r} (keys: {sorted(obj)})"
    if label_key not in obj:
        return None, f"missing key {label_key!r} (keys: {sorted(obj)})"
    prompt, label = obj[key], obj[label_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, f"{key!r} is empty"
    else:
        try:
            as_messages(prompt)
        except ChatFormatError as e:
            return None, f"{key!r}: {e}"
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        return None, f"{label_key!r} must be a string or a number, got {type(label).__name__}"
    label = str(label)
    if not label.strip():
        return None, f"{label_key!r} is empty"
    return {"prompt": prompt, "label": label}, None


def read_records(
    path: str | Path, *, prompt_key: str = "prompt", label_key: str = "label", max_problems: int = 20
) -> list[dict]:
    """All records of a jsonl (or parquet) file as ``{"prompt", "label"}`` dicts, validated.

    Raises DataFormatError listing up to ``max_problems`` bad records as ``file:line: reason``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records: list[dict] = []
    problems: list[str] = []
    total_bad = 0
    for where, obj in _iter_raw(path):
        rec, problem = _validate(obj, prompt_key, label_key)
        if problem is not None:
            total_bad += 1
            if len(problems) < max_problems:
                problems.append(f"{where}: {problem}")
        else:
            records.append(rec)
    if total_bad:
        raise DataFormatError(path, problems, total_bad)
    if not records:
        raise DataError(f"{path}: no records")
    return records


PROMPT_PLACEHOLDER = "{prompt}"


def load_prompts(path: str | Path, *, prompt_template: str | None = None, limit: int | None = None) -> list[dict]:
    """Records for rollout or eval: ``{"prompt": [messages], "label": str}``.

    ``prompt_template`` rewrites the last user message: every ``{prompt}`` in it is replaced by the original
    text (plain replacement, so LaTeX braces in the template need no escaping). ``limit`` keeps the first N.
    """
    if prompt_template is not None and PROMPT_PLACEHOLDER not in prompt_template:
        raise DataError(f"prompt_template must contain {PROMPT_PLACEHOLDER!r}, got {prompt_template!r}")
    if limit is not None and limit < 1:
        raise DataError(f"limit must be >= 1, got {limit}")
    out = []
    for rec in read_records(path)[:limit]:
        messages = as_messages(rec["prompt"])
        if prompt_template is not None:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if not users:
                raise DataError(f"{path}: a record has no user message to template: {rec['prompt']!r:.200}")
            m = messages[users[-1]]
            m["content"] = prompt_template.replace(PROMPT_PLACEHOLDER, m["content"])
        out.append({"prompt": messages, "label": rec["label"]})
    return out


def write_records(path: str | Path, records: Iterable[dict]) -> int:
    """Write records as jsonl atomically (a reader never sees half a file). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n
