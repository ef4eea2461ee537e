"""The SGLang rollout engine: the DESIGN engine protocol on ``sglang.Engine`` (the ``cluster`` extra).

SGLang cannot be installed on the development machines (it pins a CUDA torch), so this package is written
against the source of the pinned release (``surface.SGLANG_VERSION``) and checked against it without running it:
``tests/unit/test_sglang_contract.py`` downloads that release and verifies, with ``ast``, every name in
``surface.SGLANG_SURFACE`` (methods, keywords, request fields, attributes) and every server argument that
``server_args.build_server_args`` emits. The same test reads ``backend.SGLangBackend`` — the only code here that
touches sglang — and fails if it uses anything the surface list does not declare, so the two cannot drift.

How the protocol maps onto SGLang (``miles-k3-recipe.md`` §4.5, §5):

| protocol | SGLang |
|---|---|
| ``generate`` | ``Engine.generate(input_ids=…, sampling_params=[…], return_logprob=True, lora_path=[name, …])`` |
| ``load_adapter`` | ``pause_generation(retract)``, ``flush_cache``, ``unload_lora_adapter`` (the previous version), |
| | ``load_lora_adapter_from_tensors`` (flattened buckets), ``update_weight_version``, ``continue_generation`` |
| ``release_memory(tags)`` | ``flush_cache`` then ``release_memory_occupation(tags)`` |
| ``resume_memory(tags)`` | ``resume_memory_occupation(tags)`` |

Adapter transport. SGLang takes each chunk as one serialized ``FlattenedTensorBucket`` per engine TP rank (one
flat ``uint8`` tensor plus per-tensor byte ranges, serialized with SGLang's ``MultiprocessingSerializer``: a CUDA
IPC handle for a GPU bucket, shared memory for a CPU one; ``load_format="flattened_bucket"``), and TP rank ``i``
opens entry ``i``. A CUDA IPC handle opens only on the node that made it, so, as in the recipe (§4.5), engine rank
``i`` gets the payload that the trainer rank on its GPU (training rank ``e·TP + i``) made of its own full copy of
the chunk: the engine is *fed rank by rank* (``k3.transport.rank_feed``). Every trainer rank of the engine puts the
chunk in its own bucket, serializes that bucket's bytes as they are (``rank_payload``), and the payloads — handle
bytes only — are gathered to the source rank over a Gloo group per engine (``k3.transport.feed_group``); the source
hands the list to the head, which checks each payload was made by its engine rank's trainer rank, on that node and
GPU, of the same chunk as the source's (chunk digests equal), and passes the list to SGLang unchanged; every trainer
rank frees its bucket only after SGLang replied (``k3.transport.fed_producer``). With ``verify_checksums`` the source
sends each tensor's SHA-256 and SGLang checks every rank's payload against them. This is the only way into an
engine that spans nodes (TP16 over 4 nodes of 4 GPUs). Without rank slots (an in-process engine wider than one GPU)
or in ``whole`` mode, the head builds one bucket from its source rank's and serializes it once per TP rank
(``payload.build_lora_payload``) — valid on one node only: ``whole`` mode refuses an engine that spans nodes.
Two load modes, picked from the installed SGLang:

* ``streamed`` — one ``load_lora_adapter_from_tensors`` per chunk with ``is_first_chunk``/``is_last_chunk``
  (the recipe's SGLang build accumulates the chunks and finalizes the adapter after the last one). Used when
  SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` declares those two fields.
* ``whole`` — upstream SGLang (0.5.23 has no chunk fields): the chunks of a version are validated as they
  arrive and sent as one bucket in one call. Memory: the version's adapter is held twice while it is
  flattened (fine for the 4layer variant; the full model's adapter, ~49 GB at rank 32, needs ``streamed``).

Versions: the engine serves one adapter (``max_loras_per_batch=1``) named ``engine.LORA_NAME``. As in the recipe,
the previous version is unloaded before the first chunk of a new one goes out, so a failure part-way leaves
the engine on the base model (``adapter_version() == 0``) and the error says so; ``atomic_swap=True`` loads
each version under its own name and unloads the old one only after the new one is complete (twice the host
memory of an adapter; then a failure changes nothing). Stream errors found before anything is sent (a bad
version, flags out of place, a rank above ``max_lora_rank``; in ``whole`` mode every stream error) change
nothing in either mode.

Chunk by chunk. ``load_adapter`` takes a whole stream; the trainer's hand-off delivers one chunk at a time, so
``SGLangEngine.begin_adapter`` returns an ``AdapterLoad`` that takes each chunk as it arrives (``add``)
and activates the version in ``finish`` — the same calls in the same order (``forwarder.SGLangAdapterForwarder``
forwards the hand-off's chunks this way).

Generation pause. ``load_adapter`` pauses generation itself (mode ``retract``) and continues afterwards — unless
the caller paused first, in which case the engine stays paused: the recipe continues generation only after
every trainer rank finished its sync cleanup (§5.4 step 7), so the loop calls ``SGLangEngine.pause_generation`` /
``continue_generation`` around the whole sync.

Log-probabilities: the protocol wants them under the unscaled model distribution, so the engine starts SGLang
with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (otherwise SGLang returns them after temperature / top-p).

The package, one concept per module (lowest first): ``errors``; ``surface`` (the pinned release, every name of
SGLang used, the require/version checks); ``server_args``, ``sampling``, ``results`` (a run's flags, the
protocol's sampling and SGLang's results mapped onto each other); ``payload`` (the flattened bucket);
``backend`` (every call into sglang); ``rank_payload`` (one engine rank's payload, made on a trainer rank);
``version_stream`` (one version's chunk stream checked); ``engine`` (``SGLangEngine``, ``AdapterLoad``);
``forwarder`` (the hand-off's chunks into an engine); ``placement`` (which training ranks' bundles hold each
engine's nodes, and each engine rank's trainer rank, node and GPU); ``worker`` (one node of one engine, the
loop's worker); ``start`` (every engine of a run, under Ray or in process); ``kind`` (what the loop and the
launcher know of it: its entry in ``k3.rollout.registry``; cheap to import).
"""
