"""XTML prompts: the chat format K3 is trained on, as text for the tokenizer.

An element is ``<|open|>tag attrs<|sep|> … <|close|>tag<|sep|>`` and a message ends with ``<|end_of_msg|>``.
A prompt is the rendered conversation followed by the assistant generation prefix; in thinking mode that is
``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>``, so the model's completion is
``…<|close|>think<|sep|><|open|>response<|sep|>…<|end_of_msg|>`` and the deepscaler reward reads the text after
``<|open|>response<|sep|>``.

This renders what the RL loop needs (system/user/assistant text messages). For the released model, the
checkpoint's own encoder (``encoding_k3.py``) is the authority on anything richer (tools, media, options).
"""

from __future__ import annotations

from collections.abc import Sequence

from k3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, Tokenizer

Message = dict[str, str]  # {"role": "user" | "system" | "assistant", "content": str}

ROLES = ("system", "user", "assistant")


class ChatFormatError(ValueError):
    """A prompt that is neither a string nor a list of {role, content} messages."""


def _open(tag: str) -> str:
    return f"{OPEN}{tag}{SEP}"


def _close(tag: str) -> str:
    return f"{CLOSE}{tag}{SEP}"


def assistant_prefix(thinking: bool = True) -> str:
    """The generation prefix: the assistant message header and the first channel (think or response)."""
    return _open('message role="assistant"') + _open("think" if thinking else "response")


def assistant_completion(think: str, response: str) -> str:
    """What the model generates after ``assistant_prefix(thinking=True)``: think, switch channel, respond, end."""
    return f"{think}{_close('think')}{_open('response')}{response}{END_OF_MSG}"


def as_messages(prompt: str | Sequence[Message]) -> list[Message]:
    """A dataset prompt as messages: a string is one user message; a list is validated and copied."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise ChatFormatError(f"prompt must be a string or a non-empty list of messages, got {type(prompt).__name__}")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatFormatError(f"message {i} must be {{'role': str, 'content': str}}, got {m!r}")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def prompt_segments(prompt: str | Sequence[Message], *, thinking: bool = True) -> list[tuple[str, bool]]:
    """The prompt as ``(text, is_structure)`` segments: structure carries markers, content is user text.

    Content is encoded with ``allow_special=False`` so a marker string typed by a user stays plain text.
    Historical assistant turns keep an (empty) think channel, as K3's preserved-thinking format requires.
    """
    segs: list[tuple[str, bool]] = []
    for m in as_messages(prompt):
        segs.append((_open(f'message role="{m["role"]}"'), True))
        if m["role"] == "assistant":
            segs.append((_open("think") + _close("think") + _open("response"), True))
        segs.append((m["content"], False))
        segs.append((END_OF_MSG, True))
    segs.append((assistant_prefix(thinking), True))
    return segs


def build_prompt(prompt: str | Sequence[Message], *, thinking: bool = True) -> str:
    """The prompt text (conversation + generation prefix). For token ids prefer :func:`encode_prompt`."""
    return "".join(text for text, _ in prompt_segments(prompt, thinking=thinking))


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[Message], *, thinking: bool = True) -> list[int]:
    """Prompt token ids, markers as special tokens and message content as plain text."""
    ids: list[int] = []
    for text, is_structure in prompt_segments(prompt, thinking=thinking):
        ids.extend(tokenizer.encode(text, allow_special=is_structure))
    return ids
