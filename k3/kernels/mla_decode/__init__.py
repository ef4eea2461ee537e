"""MLA decode attention in the latent space (the absorbed form): one query token per sequence against a cache of
``RMSNorm(c_kv)`` (``ckv``, 512 wide for K3) and the shared key part (``kpe``, 64 wide).

``naive`` holds the torch forms — ``mla_decode_masked`` over a dense window with a key mask (what the model's
capturable decode step runs by default) and ``mla_decode_paged_reference`` over a paged cache, request by request
(the plain reference the fast kernel is tested against); ``flashinfer`` binds flashinfer's paged MLA kernel and
its sampling kernel (the project's only flashinfer calls, optional import).
"""
