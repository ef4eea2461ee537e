"""``SGLangEngine``: the rollout-engine protocol on ``sglang.Engine``, plus the sync controls the loop needs, and
``AdapterLoad``: one adapter version going into it chunk by chunk (see the package docstring for how the protocol
maps onto SGLang)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from k3.rollout.errors import AdapterVersionError, EngineStateError
from k3.rollout.protocol import MEMORY_TAGS, GenerateRequest, Sample, SamplingParams, check_tags
from k3.rollout.sglang.backend import SGLangBackend
from k3.rollout.sglang.errors import SGLangError
from k3.lora.digest import chunk_digest
from k3.rollout.sglang.payload import build_lora_payload, tensor_checksums
from k3.rollout.sglang.results import sample_from_output
from k3.rollout.sglang.sampling import build_sampling_params
from k3.rollout.sglang.server_args import build_server_args
from k3.rollout.sglang.surface import STREAMED_LOAD_FIELDS
from k3.rollout.sglang.version_stream import VersionStream
from k3.settings.colocate import ColocateSettings
from k3.settings.lora import LoRAConfig
from k3.settings.rollout import RolloutSettings

__all__ = ["LOAD_MODES", "LORA_NAME", "PAUSE_MODES", "AdapterLoad", "SGLangEngine"]

log = logging.getLogger(__name__)

LORA_NAME = "k3_lora"
PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_MODES = ("auto", "streamed", "whole")


class SGLangEngine:
    """The rollout-engine protocol on ``sglang.Engine``, plus the sync controls the trainer needs.

    ``server_args``: ``sglang.Engine`` keywords (:func:`build_server_args`; :meth:`from_settings` builds them
    from a run's settings). ``tokenizer``: optional, with ``eos_id`` (added to the stop tokens, like the embedded
    engine) and ``decode`` (used only if SGLang returns no text). ``load_mode``: ``auto`` (``streamed`` when the
    installed SGLang takes chunk streams, else ``whole``), ``streamed`` or ``whole``. ``atomic_swap``: keep the
    previous version until the new one is complete. ``pause_mode``: SGLang's pause mode around an adapter
    load. ``verify_checksums``: SGLang checks every received tensor's SHA-256 (``--check-weight-update-equal``).
    ``backend`` replaces the SGLang binding (tests).
    """

    def __init__(
        self,
        server_args: Mapping[str, Any],
        *,
        tokenizer: Any | None = None,
        lora_name: str = LORA_NAME,
        load_mode: str = "auto",
        atomic_swap: bool = False,
        pause_mode: str = "retract",
        verify_checksums: bool = False,
        backend: Any | None = None,
    ) -> None:
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode={load_mode!r}: expected one of {LOAD_MODES}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: expected one of {PAUSE_MODES}")
        if not server_args.get("enable_lora"):
            raise ValueError("server_args: enable_lora is not set, so the engine could never take an adapter "
                             "(build them with build_server_args)")
        self.server_args = dict(server_args)
        self.tp_size = int(server_args.get("tp_size", 1))  # engine ranks: one payload each per load
        self._backend = backend if backend is not None else SGLangBackend(self.server_args)
        streamed = bool(getattr(self._backend, "supports_streamed_load", False))
        if load_mode == "streamed" and not streamed:
            raise SGLangError(f"load_mode='streamed' needs an SGLang whose LoadLoRAAdapterFromTensorsReqInput has "
                              f"{' and '.join(STREAMED_LOAD_FIELDS)} (the recipe's build); this one has not: use "
                              "load_mode='whole' (or 'auto')")
        self.load_mode = ("streamed" if streamed else "whole") if load_mode == "auto" else load_mode
        self.tokenizer = tokenizer
        self.lora_name = lora_name
        self.atomic_swap = atomic_swap
        self.pause_mode = pause_mode
        self.verify_checksums = verify_checksums
        self._chunk_digests: dict[int, str] = {}  # of the active version, by chunk index (adapter_report)
        self._stop_ids = (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ()
        self._max_rank = server_args.get("max_lora_rank")
        targets = server_args.get("lora_target_modules")
        self._served_targets = set(targets) if targets and targets != "all" else None
        self._version = 0
        self._loaded: str | None = None  # the SGLang adapter name now serving, if any
        self._released: set[str] = set()
        self._paused = False
        self._closed = False
        self._open_load: AdapterLoad | None = None

    @classmethod
    def from_settings(cls, rollout: RolloutSettings, lora: LoRAConfig, colocate: ColocateSettings,
                      server_overrides: Mapping[str, Any] | None = None, **engine_kwargs: Any) -> "SGLangEngine":
        """An engine for one rollout engine of a run, from its settings (:func:`build_server_args`)."""
        args = build_server_args(rollout, lora, colocate, **dict(server_overrides or {}))
        engine_kwargs.setdefault("verify_checksums", bool(rollout.check_weight_update_equal))
        return cls(args, **engine_kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """One response per request, in order, with the adapter now loaded (none before the first version)."""
        self._check_open()
        if self._released:
            raise EngineStateError(f"generate() while memory tags {sorted(self._released)} are released: call "
                                   "resume_memory first")
        if self._paused:
            raise EngineStateError("generate() while generation is paused: call continue_generation() first")
        if not requests:
            return []
        if any(len(r.prompt_ids) == 0 for r in requests):
            raise ValueError("a request has an empty prompt: every prompt needs at least one token")
        params = build_sampling_params(sampling, len(requests), self._stop_ids)
        lora = [self._loaded] * len(requests) if self._loaded is not None else None
        outputs = self._backend.generate([list(r.prompt_ids) for r in requests], params, lora)
        if len(outputs) != len(requests):
            raise SGLangError(f"SGLang returned {len(outputs)} results for {len(requests)} requests")
        decode = getattr(self.tokenizer, "decode", None)
        return [sample_from_output(o, r, self._version, decode) for o, r in zip(outputs, requests)]

    # ------------------------------------------------------------------ adapters
    def adapter_version(self) -> int:
        return self._version

    def adapter_report(self) -> dict[str, Any]:
        """``{"version": V, "chunk_digests": {chunk index: digest}}``: the ``k3.lora.digest.chunk_digest`` of each
        chunk of the active version as it was handed to SGLang (with ``verify_checksums`` SGLang checked every
        tensor of it against its SHA-256 on arrival); empty while the engine serves the base model."""
        digests = self._chunk_digests if self._version else {}
        return {"version": self._version, "chunk_digests": dict(digests)}

    def load_adapter(self, chunks: Iterable[Any], version: int) -> None:
        """Load adapter ``version`` from its ``AdapterChunk`` stream (``is_first`` … ``is_last``).

        Pauses generation and flushes the cache first (continuing afterwards only if it paused it), unloads the
        previous version (see the module docstring for ``atomic_swap``), sends the buckets and sets SGLang's
        weight version to ``str(version)``. No request may still be running on the previous adapter: SGLang's
        unload waits for those to finish (``generate`` here returns only when its requests are done). Raises
        ``AdapterVersionError`` for a malformed stream and :class:`SGLangError` when SGLang refuses a call.
        The same as :meth:`begin_adapter`, :meth:`AdapterLoad.add` per chunk, :meth:`AdapterLoad.finish`.
        """
        load = self.begin_adapter(version)
        try:
            for chunk in chunks:
                load.add(chunk)
            load.finish()
        except Exception as e:
            if load.is_open:  # the chunk iterator itself failed
                raise load.abort(e) from e
            raise
        finally:
            if load.is_open:  # interrupted (KeyboardInterrupt): never leave the engine paused on a partial version
                load.abort(EngineStateError(f"loading adapter version {version} was interrupted"))

    def begin_adapter(self, version: int) -> AdapterLoad:
        """Start loading adapter ``version`` chunk by chunk, as the chunks arrive (the trainer's hand-off forwards
        each one on receipt). Pauses generation (unless the caller did) and flushes the cache now; returns the
        :class:`AdapterLoad` to ``add`` the chunks to and ``finish``. One load at a time."""
        self._check_open()
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise AdapterVersionError(f"adapter version {version!r}: expected an integer >= 1")
        if self._open_load is not None:
            raise EngineStateError(f"adapter version {version}: version {self._open_load.version} is still being "
                                   "loaded (finish or abort it first)")
        if version <= self._version:
            raise AdapterVersionError(f"adapter version {version} is not newer than the active version "
                                      f"{self._version}")
        if "weights" in self._released:
            raise EngineStateError("load_adapter() while the engine's weights are released: resume_memory(['weights'])"
                                   " first (the recipe onloads the engine's weights before update_weights)")
        return AdapterLoad(self, version)

    def _name_for(self, version: int) -> str:
        return f"{self.lora_name}_v{version}" if self.atomic_swap else self.lora_name

    def _unload_current(self) -> None:
        name, self._loaded = self._loaded, None
        if name is not None:
            # From here on the engine serves the base model; a failure later leaves it so.
            self._version = 0
            self._backend.unload_lora(name)

    def _activate(self, name: str, version: int, old: str | None) -> None:
        self._loaded, self._version = name, version
        if self.atomic_swap and old is not None and old != name:
            self._backend.unload_lora(old)
        log.info("adapter version %d loaded into SGLang as %s (%s mode)", version, name, self.load_mode)

    def _failed(self, error: Exception, version: int, name: str, sent: bool) -> Exception:
        """Clean up a broken load and say which adapter the engine serves now."""
        if sent:
            try:  # a half-received adapter must not linger under the name
                self._backend.unload_lora(name)
            except Exception as cleanup:  # noqa: BLE001 - the original error is the one to report
                log.warning("unloading the partial adapter %s failed: %s", name, cleanup)
        if self._loaded is None and self._version == 0:
            try:  # SGLang still reports the unloaded version; samples must not claim it
                self._backend.update_weight_version("0")
            except Exception as cleanup:  # noqa: BLE001
                log.warning("resetting SGLang's weight version failed: %s", cleanup)
        now = (f"the engine still serves version {self._version}" if self._loaded is not None
               else "the engine now serves the base model without an adapter (adapter_version() == 0); send a "
                    "complete version again")
        if isinstance(error, EngineStateError):
            kind: type[Exception] = EngineStateError
        elif isinstance(error, (ValueError, TypeError)):  # the stream itself was bad
            kind = AdapterVersionError
        else:
            kind = SGLangError
        return kind(f"loading adapter version {version} failed: {error}; {now}")

    # ------------------------------------------------------------------ sync controls
    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause_generation(self, mode: str | None = None) -> None:
        """Stop scheduling generation (``retract``: running requests go back to the queue). Idempotent."""
        self._check_open()
        mode = mode or self.pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {PAUSE_MODES}")
        if not self._paused:
            self._backend.pause_generation(mode)
            self._paused = True

    def continue_generation(self) -> None:
        """Resume generation after :meth:`pause_generation`. Idempotent."""
        self._check_open()
        if self._paused:
            self._backend.continue_generation()
            self._paused = False

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache."""
        self._check_open()
        self._backend.flush_cache()

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: Sequence[str]) -> None:
        """Release the tagged GPU regions (``weights``, ``kv_cache``, ``cuda_graph``); already released ones are
        skipped. The cache is flushed first, as SGLang requires. Releasing ``weights`` needs the host backup
        (``enable_weights_cpu_backup``), without which the base would be lost."""
        self._check_open()
        todo = [t for t in MEMORY_TAGS if t in check_tags(tags) and t not in self._released]
        if not todo:
            return
        if not self.server_args.get("enable_memory_saver"):
            raise EngineStateError("release_memory needs the server arg enable_memory_saver (offload_rollout)")
        if "weights" in todo and not self.server_args.get("enable_weights_cpu_backup"):
            raise EngineStateError("release_memory(['weights']) without a host backup would lose the base weights: "
                                   "enable lora_base_cpu_backup (server arg enable_weights_cpu_backup)")
        self._backend.flush_cache()
        self._backend.release_memory(todo)
        self._released.update(todo)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Resume the tagged regions that are released (resuming one that never was is skipped: SGLang's memory
        saver treats that as fatal)."""
        self._check_open()
        todo = [t for t in MEMORY_TAGS if t in check_tags(tags) and t in self._released]
        if todo:
            self._backend.resume_memory(todo)
            self._released.difference_update(todo)

    def released_tags(self) -> list[str]:
        return sorted(self._released)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("the SGLang engine was shut down")


class AdapterLoad:
    """One adapter version going into SGLang chunk by chunk (:meth:`SGLangEngine.begin_adapter`).

    ``add(chunk)`` for every chunk in stream order, then ``finish()``. In ``streamed`` mode each chunk goes out at
    once as one flattened bucket with its first/last flags (the first also unloads the previous version, unless
    ``atomic_swap``); in ``whole`` mode the chunks are checked as they arrive and sent as one bucket by
    ``finish``, which also sets SGLang's weight version. A version becomes active only in ``finish``, after its
    last chunk: an error anywhere (or :meth:`abort`) unloads what SGLang received of it, resumes generation if
    this load paused it, and the error raised says which adapter the engine serves now. A load that failed or
    finished is closed; using it again raises ``EngineStateError``.
    """

    def __init__(self, engine: SGLangEngine, version: int) -> None:
        self._engine = engine
        self.version = version
        self._stream = VersionStream(version, engine._max_rank, engine._served_targets)
        self._name = engine._name_for(version)
        self._old = engine._loaded
        self._named: list[tuple[str, torch.Tensor]] = []  # whole mode: the version's tensors until finish()
        self._digests: list[str] = []  # chunk_digest of each accepted chunk, in order
        self._sent = False  # from the first send on, SGLang may hold part of this version
        self._paused_here = not engine.is_paused
        self.is_open = True
        engine._open_load = self
        engine.pause_generation()
        try:
            engine._backend.flush_cache()
        except Exception as e:
            raise self.abort(e) from e

    @property
    def chunks(self) -> int:
        """How many chunks were accepted so far."""
        return self._stream.count

    def add(self, chunk: Any) -> None:
        """Check ``chunk`` against the stream and (``streamed``) send it to SGLang now."""
        self._check_open()
        engine = self._engine
        try:
            self._stream.accept(chunk)
            self._digests.append(chunk_digest(chunk.tensors))
            if engine.load_mode == "whole":
                self._named.extend(chunk.tensors)
                return
            if self._stream.count == 1 and not engine.atomic_swap:
                engine._unload_current()
            flat, entries = build_lora_payload(chunk)
            checksums = tensor_checksums(chunk.tensors) if engine.verify_checksums else None
            self._sent = True
            engine._backend.load_lora_bucket(self._name, self._stream.config, flat, entries,
                                             (bool(chunk.is_first), bool(chunk.is_last)), checksums)
            del flat
        except Exception as e:
            raise self.abort(e) from e

    def add_payloads(self, chunk: Any, payloads: Sequence[bytes], digest: str,
                     checksums: dict[str, str] | None) -> None:
        """Check ``chunk`` against the stream and send it to SGLang now as ``payloads``, engine rank ``i``'s
        serialized bucket at ``i``, passed on as they are (``streamed`` only: an engine fed rank by rank).

        ``chunk`` carries the chunk's names, shapes and place in the stream (its tensors may be on ``meta``: this
        process never opens a payload, which is made for another process, often on another node); ``digest`` is
        the chunk digest of the tensors in the payloads (the report's record); ``checksums`` each tensor's
        SHA-256, sent for SGLang to check on every rank when ``verify_checksums``."""
        self._check_open()
        engine = self._engine
        try:
            if engine.load_mode != "streamed":
                raise SGLangError(f"per-rank payloads need the streamed load mode (this engine loads "
                                  f"{engine.load_mode!r}: one bucket per version, made here)")
            if len(payloads) != engine.tp_size:
                raise SGLangError(f"chunk {self._stream.count} came with {len(payloads)} rank payloads for "
                                  f"{engine.tp_size} engine ranks")
            if engine.verify_checksums and checksums is None:
                raise SGLangError(f"chunk {self._stream.count} came without tensor checksums, which this engine "
                                  "verifies (--check-weight-update-equal)")
            self._stream.accept(chunk)
            self._digests.append(digest)
            if self._stream.count == 1 and not engine.atomic_swap:
                engine._unload_current()
            self._sent = True
            engine._backend.load_lora_payloads(self._name, self._stream.config, list(payloads),
                                               (bool(chunk.is_first), bool(chunk.is_last)),
                                               checksums if engine.verify_checksums else None)
        except Exception as e:
            raise self.abort(e) from e

    def finish(self) -> None:
        """The stream ended: check it was complete, send it (``whole``), set the weight version, activate."""
        self._check_open()
        engine = self._engine
        try:
            self._stream.finish()
            if engine.load_mode == "whole":
                flat, entries = build_lora_payload(self._named)
                checksums = tensor_checksums(self._named) if engine.verify_checksums else None
                self._named = []
                if not engine.atomic_swap:
                    engine._unload_current()
                self._sent = True
                engine._backend.load_lora_bucket(self._name, self._stream.config, flat, entries, None, checksums)
                del flat
            engine._backend.update_weight_version(str(self.version))
        except Exception as e:
            raise self.abort(e) from e
        try:
            engine._activate(self._name, self.version, self._old)
            engine._chunk_digests = dict(enumerate(self._digests))
        finally:
            self._close()

    def abort(self, error: Exception) -> Exception:
        """Give the version up: unload what SGLang holds of it, close the load; returns the error to raise (its
        message says which adapter the engine serves now). On a closed load it returns ``error`` as it is."""
        if not self.is_open:
            return error
        self._named = []
        try:
            return self._engine._failed(error, self.version, self._name, sent=self._sent)
        finally:
            self._close()

    def _close(self) -> None:
        self.is_open = False
        self._engine._open_load = None
        try:
            self._engine._backend.ipc_collect()
        finally:
            if self._paused_here:
                self._engine.continue_generation()

    def _check_open(self) -> None:
        if not self.is_open:
            raise EngineStateError(f"adapter version {self.version}: this load is closed (finished or failed); "
                                   "begin a new one")
