"""The embedded rollout engine: the reference K3 (``k3.model``) generating in process, on any device.

``engine`` (the protocol on an in-process model), ``sampling`` (token sampling), ``adapter_loader`` (a complete
adapter version, all or nothing), ``worker`` (the engine plus the receiving end of the adapter hand-off: the
loop's worker), ``start`` (the run's one engine, in process or as a Ray actor), ``kind`` (what the loop and the
launcher know of it: its entry in ``k3.rollout.registry``).
"""
