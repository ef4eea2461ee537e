#!/usr/bin/env python3
"""Give a synthetic checkpoint at the release's width a tokenizer: byte-level, with the release's vocabulary size.

`k3 make-checkpoint --variant 4layer` writes the released layout and config (vocab 163,840, bos / eos / pad at the
release's ids) but no tokenizer files, and `k3.tokenizer.load_tokenizer` speaks bytes only for the tiny layout: a
synthetic 4layer checkpoint cannot be trained on as written. The release's tiktoken BPE cannot be downloaded here.
This writes a Hugging Face fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) into the checkpoint dir:

- ids 0–255: the 256 bytes (byte-level, no merges: every byte of a prompt is one token);
- the config's bos / eos / pad ids, and the XTML markers of the chat format (``<|open|>`` ``<|sep|>`` ``<|close|>``)
  and ``[EOS]`` on the ids after the bos (the eos is ``<|end_of_msg|>``, the turn terminator, as in the release);
- every other id up to the vocabulary size: ``<|reserved_N|>``, so any id a random-weight model samples decodes.

    python3 ci/smoke_gpu_tokenizer.py CHECKPOINT_DIR

Exit 0 with one line saying what was written; 1 with one line when the config is not what it expects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["write_tokenizer", "MARKERS"]

END_OF_MSG, OPEN, CLOSE, SEP = "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"
# The specials placed after the bos, in this order, skipping the config's own eos / pad ids.
MARKERS = ("[EOS]", OPEN, CLOSE, SEP)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte → printable-unicode table (what the ByteLevel pre-tokenizer emits), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_tokenizer(checkpoint: Path) -> str:
    """Write the tokenizer files into ``checkpoint`` (its ``config.json`` gives the sizes and ids); returns the
    line to print. Raises ``ValueError`` naming what the config lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg_path = checkpoint / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    ids = {}
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{cfg_path}: {key} is {value!r}, expected a non-negative integer")
        ids[key] = value
    vocab_size = ids["vocab_size"]
    specials = {ids["bos_token_id"]: "[BOS]", ids["eos_token_id"]: END_OF_MSG, ids["pad_token_id"]: "[PAD]"}
    if len(specials) != 3:
        raise ValueError(f"{cfg_path}: bos, eos and pad ids must differ, got {ids}")
    free = (i for i in range(ids["bos_token_id"] + 1, vocab_size) if i not in specials)
    for marker in MARKERS:
        specials[next(free)] = marker
    alphabet = _byte_alphabet()
    if max(specials) >= vocab_size or min(specials) < len(alphabet):
        raise ValueError(f"{cfg_path}: special ids {sorted(specials)} must lie in [256, {vocab_size})")
    vocab = {}
    for i in range(vocab_size):
        vocab[alphabet[i] if i < len(alphabet) else specials.get(i, f"<|reserved_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    tok.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": END_OF_MSG,
        "pad_token": "[PAD]", "model_max_length": int(cfg.get("max_position_embeddings", 262144)),
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return (f"smoke_gpu_tokenizer: {checkpoint}/tokenizer.json: {vocab_size} ids, bytes 0-255, "
            + ", ".join(f"{name} {i}" for i, name in sorted(specials.items())))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (Path(argv[0]) / "config.json").is_file():
        print("usage: python3 ci/smoke_gpu_tokenizer.py CHECKPOINT_DIR (a directory with config.json)",
              file=sys.stderr)
        return 1
    try:
        print(write_tokenizer(Path(argv[0])))
    except (ValueError, json.JSONDecodeError) as e:
        print(f"smoke_gpu_tokenizer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
