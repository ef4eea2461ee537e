"""SGLang's generate results as the protocol's samples."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from k3.rollout.protocol import GenerateRequest, Sample
from k3.rollout.sglang.errors import SGLangError
from k3.rollout.sglang.surface import SGLANG_FINISH_TYPES

__all__ = ["sample_from_output"]


def sample_from_output(output: Mapping[str, Any], request: GenerateRequest, adapter_version: int,
                       decode: Callable[[list[int]], str] | None = None) -> Sample:
    """Map one SGLang generate result onto a :class:`Sample`.

    ``output`` is SGLang's dict: ``output_ids`` (response tokens), ``text``, ``meta_info`` with
    ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``), ``output_token_logprobs``
    (``[(logprob, token_id, text | None), ...]``, one per response token) and ``weight_version`` (the adapter
    version that finished the request, a string). ``adapter_version`` is used when the engine's
    ``weight_version`` is not a number; ``decode`` supplies the text when SGLang returns none
    (``skip_tokenizer_init``). Raises :class:`SGLangError` on an aborted, unfinished or inconsistent result.
    """
    meta = output.get("meta_info") if isinstance(output, Mapping) else None
    rid = meta.get("id", "?") if isinstance(meta, Mapping) else "?"
    if not isinstance(meta, Mapping) or "output_ids" not in output:
        keys = sorted(output) if isinstance(output, Mapping) else type(output).__name__
        raise SGLangError(f"SGLang result {rid}: expected keys output_ids and meta_info, got {keys}")
    tokens = [int(t) for t in output["output_ids"]]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind == "abort":
        message = finish.get("message", "") if isinstance(finish, Mapping) else ""
        raise SGLangError(f"SGLang aborted request {rid}: {message or 'no reason given'}")
    if kind not in SGLANG_FINISH_TYPES:
        raise SGLangError(f"SGLang result {rid}: finish_reason {finish!r} is not stop or length (unfinished?)")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangError(f"SGLang result {rid}: no output_token_logprobs (the request must set return_logprob)")
    logprobs = [float(e[0]) for e in entries]
    logprob_ids = [int(e[1]) for e in entries]
    if logprob_ids != tokens:
        raise SGLangError(f"SGLang result {rid}: {len(entries)} logprobs for {len(tokens)} tokens, or their token "
                          "ids differ from output_ids")
    text = output.get("text")
    if text is None:
        text = decode(tokens) if decode is not None else ""
    weight_version = str(meta.get("weight_version", ""))
    version = int(weight_version) if weight_version.isdigit() else adapter_version
    return Sample(prompt_ids=list(request.prompt_ids), tokens=tokens, text=text, logprobs=logprobs,
                  finish_reason=SGLANG_FINISH_TYPES[kind], adapter_version=version, meta=dict(request.meta))
