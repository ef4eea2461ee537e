"""Tokenizers: the protocol the trainer and the engines use, a byte tokenizer for the tiny model, HF loading.

The release ships a tiktoken BPE (163,840 ids) loaded through HF ``AutoTokenizer`` with remote code. The tiny
model has no trained vocabulary, so it speaks bytes: 256 byte tokens plus the XTML structural specials
(``<|open|> <|sep|> <|close|> <|end_of_msg|>``) and bos/eos/pad, laid out to agree with ``variant("tiny")``
(vocab 512, pad 0, bos 1, eos 2). As in the release, the eos the model stops on is ``<|end_of_msg|>`` (the turn
terminator), not the document-level ``[EOS]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

OPEN = "<|open|>"
SEP = "<|sep|>"
CLOSE = "<|close|>"
END_OF_MSG = "<|end_of_msg|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the RL stack needs from a tokenizer. Ids are plain ints; no special tokens are added implicitly."""

    bos_id: int
    eos_id: int  # the id generation stops on: <|end_of_msg|>
    pad_id: int
    vocab_size: int

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``. With ``allow_special=False`` marker strings are encoded as plain text."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are rendered as their marker strings."""
        ...


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or was given ids it does not know."""


class ByteTokenizer:
    """Bytes as tokens for the tiny model: ids 16..271 are bytes 0..255, 0..6 the specials, the rest reserved.

    ``vocab_size`` is the model's (512, padded like the release's reserved block); ids 7..15 and 272..511 are
    reserved: they decode to ``<|reserved_N|>`` so a sampled untrained id is visible rather than silently lost.
    """

    SPECIALS: ClassVar[dict[str, int]] = {
        "[PAD]": 0,
        "[BOS]": 1,
        END_OF_MSG: 2,
        "[EOS]": 3,
        OPEN: 4,
        CLOSE: 5,
        SEP: 6,
    }
    BYTE_OFFSET = 16
    vocab_size = 512
    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self) -> None:
        self._special_by_id = {i: s for s, i in self.SPECIALS.items()}
        # Longest first so no marker can be split by a shorter one that prefixes it.
        alternatives = sorted(self.SPECIALS, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")

    def _encode_plain(self, text: str) -> list[int]:
        return [b + self.BYTE_OFFSET for b in text.encode("utf-8")]

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if not allow_special:
            return self._encode_plain(text)
        ids: list[int] = []
        for piece in self._special_re.split(text):
            if piece in self.SPECIALS:
                ids.append(self.SPECIALS[piece])
            elif piece:
                ids.extend(self._encode_plain(piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        pending = bytearray()  # consecutive byte tokens, decoded together so multi-byte UTF-8 survives

        def flush() -> None:
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()

        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
            if self.BYTE_OFFSET <= i < self.BYTE_OFFSET + 256:
                pending.append(i - self.BYTE_OFFSET)
                continue
            flush()
            out.append(self._special_by_id.get(i, f"<|reserved_{i}|>"))
        flush()
        return "".join(out)


class HFTokenizer:
    """A HF tokenizer behind the protocol; ``eos_id`` is the turn terminator the model config names."""

    def __init__(self, tok, eos_id: int, bos_id: int, pad_id: int) -> None:
        self._tok = tok
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.pad_id = pad_id
        self.vocab_size = len(tok)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if allow_special:
            return list(self._tok.encode(text, add_special_tokens=False))
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "tokenizer.model", "vocab.json")


def _model_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return {}
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from e
    # The release nests the language model's fields under text_config.
    return cfg.get("text_config", cfg)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint dir: HF ``AutoTokenizer`` when it has tokenizer files, else bytes for tiny.

    Without tokenizer files the dir's ``config.json`` must describe the tiny layout (vocab 512, pad 0, bos 1,
    eos 2): a byte tokenizer on a real checkpoint would produce garbage, so anything else is an error.
    """
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"{path}: not a directory (expected a checkpoint dir with config.json)")
    cfg = _model_config(path)
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
        # Prefer the model's configured eos (K3: <|end_of_msg|>) over the tokenizer's document [EOS].
        eos = cfg.get("eos_token_id")
        if eos is None:
            end_id = tok.convert_tokens_to_ids(END_OF_MSG)
            eos = end_id if isinstance(end_id, int) and end_id != tok.unk_token_id else tok.eos_token_id
        if eos is None:
            raise TokenizerError(f"{path}: cannot tell the eos id (no eos_token_id in config.json or tokenizer)")
        bos = cfg.get("bos_token_id", tok.bos_token_id)
        pad = cfg.get("pad_token_id", tok.pad_token_id)
        return HFTokenizer(
            tok, eos_id=int(eos), bos_id=-1 if bos is None else int(bos), pad_id=-1 if pad is None else int(pad)
        )

    byte = ByteTokenizer()
    want = {
        "vocab_size": byte.vocab_size,
        "pad_token_id": byte.pad_id,
        "bos_token_id": byte.bos_id,
        "eos_token_id": byte.eos_id,
    }
    got = {k: cfg.get(k) for k in want}
    if got != want:
        raise TokenizerError(
            f"{path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}) and config.json {got} is not the tiny "
            f"layout {want}; copy the release's tokenizer files into the checkpoint dir"
        )
    return byte
